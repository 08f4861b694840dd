/* trajstore view: the helpers every page script uses, loaded after plotly_text.js and before them
   (app.py's SCRIPTS gives the order; the exported file inlines the same scripts in the same order).
   window.trajstoreView holds them, and each page script adds what it builds: run.js the run curves,
   step.js the trajectory table, tokens.js the token view and the trajectory page, diff.js the diff
   page; view.js picks the page, compare.js adds the sections of two runs. Dump data is only ever set
   with textContent or setAttribute, never parsed as HTML. */
(function (root) {
  "use strict";
  var body = document.body, app = document.getElementById("app");

  // an element with its attributes (setAttribute) and its text (textContent): never HTML
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function get(url) {  // the JSON of an /api/ route; a server error's message as the Error's
    return fetch(url).then(function (r) {
      return r.json().then(function (j) { if (!r.ok) throw new Error(j.error || ("HTTP " + r.status)); return j; });
    });
  }
  function enc(s) { return encodeURIComponent(s); }
  function raw(v) { return v === null || v === undefined ? "" : String(v); }
  // a value as text: a fraction to `digits` significant digits, no value as `none`
  function prec(v, digits, none) {
    if (v === null || v === undefined) return none;
    if (typeof v === "number" && !Number.isInteger(v)) return String(Number(v.toPrecision(digits)));
    return String(v);
  }
  function show(v) { return prec(v, 6, ""); }
  function error(parent, id, e) {  // a failure's message, as text, in `parent`
    parent.appendChild(el("p", {id: id, "class": "error"}, String(e && e.message || e)));
  }
  function ready() { body.setAttribute("data-ready", "1"); }
  function fail(e) { error(app, "error", e); ready(); }

  root.trajstoreView = {body: body, app: app, PLOT: {displayModeBar: false, responsive: true}, el: el, get: get,
    enc: enc, raw: raw, prec: prec, show: show, error: error, ready: ready, fail: fail};
})(window);
