/* trajstore view: every text plotly draws is text. Plotly reads tags (<a href>, <b>, <br>, <span style>)
   and entities in titles, axis titles, annotations, legend titles and trace names; a field name or a
   value of the dump can hold any of them. Loaded after plotly.min.js and before view.js, this wraps
   Plotly.newPlot, react, update and relayout so that those texts reach plotly with & < > written as
   entities, which plotly shows as the characters themselves (hover templates, written by view.js,
   are left as they are). */
(function (root) {
  "use strict";
  var MAP = {"&": "&amp;", "<": "&lt;", ">": "&gt;"};

  function esc(s) { return String(s).replace(/[&<>]/g, function (c) { return MAP[c]; }); }

  function title(t) {
    if (typeof t === "string") return esc(t);
    if (t && typeof t === "object" && t.text !== undefined && t.text !== null) {
      var out = Object.assign({}, t);
      out.text = esc(t.text);
      return out;
    }
    return t;
  }

  function layout(l) {  // a copy: the caller's object is left as it was
    if (!l || typeof l !== "object") return l;
    var out = Array.isArray(l) ? l.slice() : Object.assign({}, l);
    Object.keys(out).forEach(function (k) {
      var v = out[k];
      if (k === "title" || /\.title(\.text)?$/.test(k)) out[k] = typeof v === "string" ? esc(v) : title(v);
      else if (k === "annotations" && Array.isArray(v)) {
        out[k] = v.map(function (a) { return a && a.text !== undefined ? Object.assign({}, a, {text: esc(a.text)}) : a; });
      } else if (v && typeof v === "object" && !(v instanceof Array) && (/axis\d*$/.test(k) || k === "legend"
          || k === "coloraxis" || k === "colorbar" || k === "scene")) out[k] = layout(v);
    });
    return out;
  }

  function trace(t) {
    if (!t || typeof t !== "object") return t;
    var out = Object.assign({}, t);
    ["name", "legendgrouptitle"].forEach(function (k) {
      if (typeof out[k] === "string") out[k] = esc(out[k]);
      else if (k === "legendgrouptitle") out[k] = title(out[k]);
    });
    return out;
  }

  function data(d) { return Array.isArray(d) ? d.map(trace) : d; }

  function wrap(P) {
    if (!P || P.__trajstoreText) return P;
    var newPlot = P.newPlot, react = P.react, update = P.update, relayout = P.relayout;
    P.newPlot = function (div, d, l, c) { return newPlot.call(P, div, data(d), layout(l), c); };
    P.react = function (div, d, l, c) { return react.call(P, div, data(d), layout(l), c); };
    if (update) P.update = function (div, d, l, i) { return update.call(P, div, d, layout(l), i); };
    if (relayout) P.relayout = function (div, l) { return relayout.call(P, div, layout(l)); };
    P.__trajstoreText = {esc: esc, layout: layout, trace: trace};
    return P;
  }

  wrap(root.Plotly);
})(typeof window !== "undefined" ? window : globalThis);
