/* trajstore view, a trajectory's tokens: each token a span (its whitespace shown, tokens that make
   whole characters only together grouped), coloured by probability, by |a - b| of a logprob pair or by
   policy version, with the colouring's legend; and the trajectory page built from them. */
(function (V) {
  "use strict";
  var body = V.body, app = V.app, el = V.el, get = V.get, enc = V.enc, raw = V.raw, show = V.show,
    ready = V.ready, fail = V.fail;
  var PALETTE = ["rgb(255, 255, 255)", "rgb(198, 219, 239)", "rgb(158, 202, 225)", "rgb(107, 174, 214)",
    "rgb(66, 146, 198)", "rgb(33, 113, 181)", "rgb(8, 81, 156)", "rgb(8, 48, 107)"];
  var MASKED = "rgb(235, 235, 235)", WHITE = "rgb(255, 255, 255)";

  function num(v) { return v === "-inf" ? -Infinity : v === "inf" ? Infinity : v === "" || v === undefined ? NaN : Number(v); }
  function red(x) { var g = Math.round(255 * Math.min(1, Math.max(0, x))); return "rgb(255, " + g + ", " + g + ")"; }
  function absdiff(t) { return Math.abs(num(t.logprob) - num(t.other)); }

  // the scale of a colouring over the trajectory's loss-mask tokens: the largest |a - b| for "diff"
  function scaleOf(toks, mode) {
    var top = 0, maxv = null;
    toks.forEach(function (t) {
      if (t.mask === 0) return;
      if (mode === "diff") { var dd = absdiff(t); if (isFinite(dd) && dd > top) top = dd; }
      if (mode === "version" && t.version !== "" && (maxv === null || Number(t.version) > maxv)) maxv = Number(t.version);
    });
    return {top: top, maxv: maxv};
  }

  function colour(t, mode, sc) {
    if (t.mask === 0) return MASKED;
    if (mode === "logprob") {
      var x = num(t.logprob);
      return isNaN(x) ? WHITE : red(Math.exp(x));
    }
    if (mode === "diff") {
      var dd = absdiff(t);
      return isNaN(dd) || !(sc.top > 0) ? WHITE : red(1 - Math.min(dd, sc.top) / sc.top);
    }
    if (mode === "version") {
      if (t.version === "" || sc.maxv === null) return WHITE;
      return PALETTE[(((sc.maxv - Number(t.version)) % 8) + 8) % 8];
    }
    return WHITE;
  }

  function fmt(x) { return String(Number(x.toPrecision(3))); }

  // the legend of a colouring: a bar (or swatches) with its scale, and the masked tokens' grey
  function legend(box, mode, sc, f, toks) {
    box.textContent = "";
    box.setAttribute("data-mode", mode);
    function sw(colour, label, attrs) {
      var it = el("span", Object.assign({"class": "swatch-item"}, attrs || {}));
      var c = el("span", {"class": "swatch"}); c.style.backgroundColor = colour;
      it.appendChild(c); it.appendChild(el("span", null, label)); box.appendChild(it);
    }
    function bar(lo, hi, title, cLo, cHi) {
      box.appendChild(el("span", {"class": "legend-title"}, title));
      box.appendChild(el("span", {"class": "tick", "data-end": "low"}, lo));
      var b = el("span", {"class": "bar", "data-low": cLo, "data-high": cHi});
      b.style.backgroundImage = "linear-gradient(to right, " + cLo + ", " + cHi + ")";
      box.appendChild(b);
      box.appendChild(el("span", {"class": "tick", "data-end": "high"}, hi));
    }
    if (mode === "logprob") {
      box.setAttribute("data-min", "0"); box.setAttribute("data-max", "1");
      bar("0", "1", "probability exp(" + f.logprob + "):", red(0), red(1));
    } else if (mode === "diff") {
      box.setAttribute("data-min", "0"); box.setAttribute("data-max", String(sc.top));
      if (sc.top > 0) bar("0", fmt(sc.top) + " (largest here)", "|" + f.logprob + " - " + f.other + "|:", red(1), red(0));
      else box.appendChild(el("span", {"class": "legend-title"}, f.logprob + " and " + f.other + " are equal at every loss-mask token"));
    } else if (mode === "version") {
      var seen = {};
      toks.forEach(function (t) { if (t.mask !== 0 && t.version !== "") seen[t.version] = true; });
      box.appendChild(el("span", {"class": "legend-title"}, f.versions + ":"));
      Object.keys(seen).map(Number).sort(function (a, b) { return b - a; }).forEach(function (v) {
        var behind = sc.maxv - v;
        sw(PALETTE[((behind % 8) + 8) % 8], v + (behind ? " (" + behind + " behind)" : " (newest)"), {"data-version": v});
      });
    }
    if (f.mask) sw(MASKED, "not in " + f.mask + " (not trained on)", {"data-masked": "1"});
  }

  var WS = {" ": "\u00b7", "\t": "\u2192", "\n": "\u21b5", "\r": "\u240d"};
  // a token's text with its whitespace shown (a dot for a space, an arrow for a tab, a return mark and a
  // real line break for a newline); its raw text stays in data-text
  function fill(span, text) {
    var buf = "";
    function flush() { if (buf) { span.appendChild(document.createTextNode(buf)); buf = ""; } }
    for (var i = 0; i < text.length; i++) {
      var c = text[i];
      if (WS[c]) { flush(); span.appendChild(el("span", {"class": "ws"}, WS[c])); if (c === "\n") span.appendChild(document.createTextNode("\n")); }
      else buf += c;
    }
    flush();
    if (!text.length) span.appendChild(el("span", {"class": "ws"}, "\u2205"));
  }

  function tokenSpan(t, j) {
    var a = {"class": "tok", "data-pos": j, "data-id": t.id, "data-logprob": t.logprob, "data-mask": t.mask,
      "data-version": t.version, "data-text": t.text, title: t.title};
    if (t.other !== undefined) a["data-other"] = t.other;
    if (t.part !== undefined) { a["data-bytes"] = t.part; a["class"] = "tok part"; }
    var s = el("span", a);
    if (t.part !== undefined) s.textContent = t.part; else fill(s, t.text);
    return s;
  }

  function tokenView(d, suffix, diverge) {
    var toks = d.tokens;
    var box = el("div", {id: "tokens" + suffix, "class": "tokens"});
    var frag = document.createDocumentFragment(), seg = null, spans = [], group = null, left = 0;
    toks.forEach(function (t, j) {
      if (seg === null || Number(seg.getAttribute("data-mask")) !== t.mask) {
        var kind = t.mask === 1 ? "response" : (j === 0 ? "prompt" : "turn");
        seg = el("div", {"class": "segment", "data-kind": kind, "data-mask": t.mask});
        frag.appendChild(seg);
        left = 0;
      }
      if (t.whole !== undefined) {  // tokens that make whole characters only together: the characters, then each token's bytes
        group = el("span", {"class": "chars", "data-text": t.whole, "data-from": j, "data-to": j + t.span - 1,
          title: "tokens " + j + "-" + (j + t.span - 1) + " together: " + JSON.stringify(t.whole)});
        var w = el("span", {"class": "whole"}); fill(w, t.whole); group.appendChild(w);
        seg.appendChild(group);
        left = t.span;
      }
      var s = tokenSpan(t, j);
      if (diverge === j) s.classList.add("diverge");
      spans.push(s);
      (left > 0 ? group : seg).appendChild(s);
      left -= 1;
    });
    box.appendChild(frag);
    function paint(mode) {
      var sc = scaleOf(toks, mode);
      spans.forEach(function (s, j) { s.style.backgroundColor = colour(toks[j], mode, sc); });
      return sc;
    }
    return {box: box, paint: paint};
  }

  function trajView(d, suffix) {
    var sec = el("section", {"class": "traj", id: "traj" + suffix});
    var f = d.fields;
    sec.appendChild(el("p", {"class": "fields"}, d.tokens.length + " tokens; ids: " + raw(f.ids || "none") +
      "; mask: " + raw(f.mask || "none") + "; logprob: " + raw(f.logprob || "none") +
      (f.other ? " vs " + f.other : "") + "; versions: " + raw(f.versions || "none")));
    var dl = el("dl", {"class": "values"});
    Object.keys(d.values).forEach(function (k) { dl.appendChild(el("dt", null, k)); dl.appendChild(el("dd", null, show(d.values[k]))); });
    sec.appendChild(dl);
    var modes = [];
    if (f.logprob) modes.push(["logprob", "colour by probability (" + f.logprob + ")"]);
    if (f.logprob && f.other) modes.push(["diff", "colour by |" + f.logprob + " - " + f.other + "|"]);
    if (f.versions) modes.push(["version", "colour by policy version (" + f.versions + ")"]);
    var bar = el("div", {"class": "colourbar"});
    var sel = el("select", {id: "colour" + suffix});
    modes.forEach(function (m) { sel.appendChild(el("option", {value: m[0]}, m[1])); });
    if (modes.length) bar.appendChild(sel);
    var key = el("div", {id: "legend" + suffix, "class": "legend"});
    bar.appendChild(key);
    sec.appendChild(bar);
    var v = tokenView(d, suffix, null);
    sec.appendChild(v.box);
    app.appendChild(sec);
    function paint() { var mode = modes.length ? sel.value : "none"; legend(key, mode, v.paint(mode), f, d.tokens); }
    paint();
    sel.addEventListener("change", paint);
  }

  function trajPage() {
    var b = body;
    get("/api/traj?split=" + enc(b.getAttribute("data-split")) + "&step=" + enc(b.getAttribute("data-step")) +
        "&index=" + enc(b.getAttribute("data-index"))).then(function (d) {
      var p = el("p"); p.appendChild(el("a", {href: "/step/" + enc(d.split) + "/" + d.step}, "back to step " + d.step));
      app.appendChild(p);
      trajView(d, "");
      ready();
    }).catch(fail);
  }

  V.tokenView = tokenView;
  V.legend = legend;
  V.trajView = trajView;
  V.trajPage = trajPage;
})(window.trajstoreView);
