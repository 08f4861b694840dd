/* trajstore view: builds each page from its JSON (/api/... or, in an exported file, the embedded
   <script id="trajstore-data" type="application/json">). Dump data is only ever set with textContent
   or setAttribute, never parsed as HTML. */
(function () {
  "use strict";
  var PALETTE = ["rgb(255, 255, 255)", "rgb(198, 219, 239)", "rgb(158, 202, 225)", "rgb(107, 174, 214)",
    "rgb(66, 146, 198)", "rgb(33, 113, 181)", "rgb(8, 81, 156)", "rgb(8, 48, 107)"];
  var MASKED = "rgb(235, 235, 235)", WHITE = "rgb(255, 255, 255)";
  var TITLES = {reward_mean: "reward mean", reward_std: "reward std", reward_min: "reward min",
    reward_max: "reward max", length_mean: "response length mean", length_p95: "response length p95",
    tokens: "tokens per step", version_lag: "policy-version lag", logprob_mismatch: "logprob mismatch |a - b|"};
  var body = document.body, app = document.getElementById("app");
  var embedded = document.getElementById("trajstore-data");
  var DATA = embedded ? JSON.parse(embedded.textContent) : null;
  var PLOT = {displayModeBar: false, responsive: true};

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function get(url) {
    return fetch(url).then(function (r) {
      return r.json().then(function (j) { if (!r.ok) throw new Error(j.error || ("HTTP " + r.status)); return j; });
    });
  }
  function fail(e) { app.appendChild(el("p", {id: "error", "class": "error"}, String(e && e.message || e))); ready(); }
  function ready() { body.setAttribute("data-ready", "1"); }
  function enc(s) { return encodeURIComponent(s); }
  function raw(v) { return v === null || v === undefined ? "" : String(v); }
  function show(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "number" && !Number.isInteger(v)) return String(Number(v.toPrecision(6)));
    return String(v);
  }

  // ---------------------------------------------------------------- run page
  var YTITLES = {reward_mean: "reward", reward_std: "reward std", reward_min: "reward", reward_max: "reward",
    length_mean: "response tokens", length_p95: "response tokens", tokens: "tokens", version_lag: "versions behind",
    logprob_mismatch: "mean |a - b| (nats)"};

  function why(d, m) {  // why a curve has no point, in words
    var f = d.fields;
    if (m.indexOf("reward") === 0 && !f.reward) return "no data: this split has no reward field";
    if (m === "version_lag" && !f.versions) return "no data: this split has no versions field";
    return "no data at these steps";
  }

  function gapped(d, ys) {  // x and y with a null at each skipped or incomplete step: the line breaks there
    var miss = d.missing.map(function (m) { return m.step; }).sort(function (a, b) { return a - b; });
    var x = [], y = [], k = 0;
    d.steps.forEach(function (s, i) {
      while (k < miss.length && miss[k] < s) {
        if (i && miss[k] > d.steps[i - 1] && (!x.length || y[y.length - 1] !== null)) { x.push(d.steps[i - 1] + 1); y.push(null); }
        k++;
      }
      x.push(s); y.push(ys[i]);
    });
    return {x: x, y: y};
  }

  function curve(div, d, m, fresh) {
    var xy = gapped(d, d.series[m]), mode = d.steps.length > 300 ? "lines" : "lines+markers";
    var trace = [{x: xy.x, y: xy.y, type: "scatter", mode: mode, name: TITLES[m] || m, line: {color: "#1f77b4"},
      hovertemplate: "step %{x}<br>%{y:.7~g}<extra></extra>"}];
    var title = TITLES[m] || m;
    if (m === "reward_mean" && d.series.reward_std) {  // the mean with a band of one standard deviation
      var sd = d.series.reward_std, bx = [], by = [], seg = [];
      function close() {  // one closed shape per run of steps with a value: mean + std forth, mean - std back
        if (!seg.length) return;
        if (bx.length) { bx.push(null); by.push(null); }
        seg.forEach(function (p) { bx.push(p[0]); by.push(p[1] + p[2]); });
        seg.slice().reverse().forEach(function (p) { bx.push(p[0]); by.push(p[1] - p[2]); });
        seg = [];
      }
      xy.x.forEach(function (x, i) {
        var k = d.steps.indexOf(x), v = xy.y[i];
        if (v === null || k < 0 || sd[k] === null) close(); else seg.push([x, v, sd[k]]);
      });
      close();
      trace.push({x: bx, y: by, type: "scatter", mode: "lines", fill: "toself", fillcolor: "rgba(31, 119, 180, 0.18)",
        line: {width: 0}, hoverinfo: "skip", showlegend: false, name: "mean \u00b1 std"});
      title = "reward mean \u00b1 std";
    }
    var empty = !d.pending && d.series[m].every(function (v) { return v === null; });
    div.setAttribute("data-empty", empty ? "1" : "0");
    var layout = {title: {text: title}, height: 250, margin: {l: 70, r: 10, t: 36, b: 40}, showlegend: false,
      xaxis: {title: {text: "step"}}, yaxis: {title: {text: YTITLES[m] || m}, automargin: true}};
    if (empty) {
      layout.xaxis.visible = false; layout.yaxis.visible = false;
      layout.annotations = [{text: why(d, m), showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
        font: {size: 14, color: "#777"}}];
    }
    return fresh ? Plotly.newPlot(div, trace, layout, PLOT) : Plotly.react(div, trace, layout, PLOT);
  }

  function runSplit(d, link) {
    var prefix = d.split === d.default_split ? "curve-" : "curve-" + d.split + "-";
    var sec = el("section", {"class": "split", "data-split": d.split});
    sec.appendChild(el("h2", null, "split " + d.split + ": " + d.steps.length + " steps"));
    var f = d.fields;
    sec.appendChild(el("p", {"class": "fields"}, "reward: " + raw(f.reward || "none") + "; mask: " +
      raw(f.mask || "none") + "; versions: " + raw(f.versions || "none") + "; logprob pair: " +
      (f.pair ? f.pair.join(" vs ") : "none")));
    var status = el("p", {"class": "pending", "data-split": d.split});
    sec.appendChild(status);
    var grid = el("div", {"class": "grid"});
    sec.appendChild(grid);
    app.appendChild(sec);
    var divs = {};
    Object.keys(d.series).forEach(function (m) {
      var div = divs[m] = el("div", {id: prefix + m, "class": "curve", "data-metric": m, "data-split": d.split});
      grid.appendChild(div);
      curve(div, d, m, true);
      if (link) div.on("plotly_click", function (ev) {
        if (ev.points && ev.points.length) location.href = "/step/" + enc(d.split) + "/" + ev.points[0].x;
      });
    });
    function note(d2) {
      status.textContent = d2.pending ? "reading the tokens of " + d2.pending + " more steps..." :
        (d2.errors && d2.errors.length ? d2.errors.length + " step(s) could not be read: " +
          d2.errors.map(function (e) { return e.step + " (" + e.error + ")"; }).join("; ") : "");
    }
    note(d);
    return {missing: d.missing.map(function (m) { m.split = d.split; return m; }), update: function (d2) {
      Object.keys(divs).forEach(function (m) { if (d2.series[m]) curve(divs[m], d2, m, false); });
      note(d2);
    }};
  }

  function missingList(all) {
    var ul = el("ul", {id: "missing"});
    all.forEach(function (m) {
      ul.appendChild(el("li", {"data-step": m.step, "data-why": m.why, "data-split": m.split},
        "step " + m.step + " (" + m.split + "): " + m.why + (m.detail ? " - " + m.detail : "")));
    });
    var sec = el("section", {"class": "missing"});
    sec.appendChild(el("h2", null, "skipped and incomplete steps: " + all.length));
    sec.appendChild(ul);
    app.appendChild(sec);
  }

  function runPage() {
    var q = new URLSearchParams(location.search), pair = q.get("pair");
    var extra = pair ? "&pair=" + enc(pair) : "";
    var splits = (body.getAttribute("data-splits") || "").split(",").filter(Boolean);
    var main = body.getAttribute("data-split");
    if (body.getAttribute("data-diff") === "1") {
      var p = el("p"); p.appendChild(el("a", {href: "/diff", id: "diff-link"}, "compare with the second dump"));
      app.appendChild(p);
    }
    var order = [main].concat(splits.filter(function (s) { return s !== main; }));
    var missing = [];
    var chain = Promise.resolve();
    order.forEach(function (s) {
      var url = "/api/run?split=" + enc(s) + extra;
      chain = chain.then(function () { return get(url + "&wait=0.5"); }).then(function (d) {
        var v = runSplit(d, true);
        missing = missing.concat(v.missing);
        function poll(prev) {  // the metrics of steps still being read come in as they are
          if (!prev.pending) return null;
          return get(url + "&wait=2").then(function (d2) { v.update(d2); return poll(d2); });
        }
        return poll(d);
      });
    });
    chain.then(function () { missingList(missing); ready(); }).catch(fail);
  }

  // ---------------------------------------------------------------- step page
  function cmp(a, b) {
    var x = a === "" ? NaN : Number(a), y = b === "" ? NaN : Number(b);
    if (!isNaN(x) && !isNaN(y)) return x - y;
    if (a === "" || b === "") return a === "" ? (b === "" ? 0 : 1) : -1;
    return a < b ? -1 : a > b ? 1 : 0;
  }

  function stepTable(d, suffix, open) {
    var sec = el("section", {"class": "step", "data-step": d.step, "data-split": d.split});
    var filter = el("input", {id: "filter" + suffix, type: "search", placeholder: "filter rows (text or number)"});
    sec.appendChild(filter);
    var hists = el("div", {"class": "grid"});
    var hr = el("div", {id: "hist-reward" + suffix, "class": "hist"}), hl = el("div", {id: "hist-length" + suffix, "class": "hist"});
    hists.appendChild(hr); hists.appendChild(hl);
    sec.appendChild(hists);
    var table = el("table", {id: "traj-table" + suffix, "class": "traj-table"});
    var head = el("tr"), thead = el("thead"), tbody = el("tbody");
    var text = {};
    (d.text || []).forEach(function (c) { text[c] = true; });
    function cls(c) { return text[c] ? "text" : "num"; }
    d.columns.forEach(function (c) { head.appendChild(el("th", {"data-key": c, "class": cls(c)}, c)); });
    thead.appendChild(head); table.appendChild(thead); table.appendChild(tbody);
    var frag = document.createDocumentFragment();
    d.rows.forEach(function (r) {
      var tr = el("tr", {"data-index": r.index});
      d.columns.forEach(function (c) { tr.appendChild(el("td", {"data-key": c, "data-value": raw(r[c]), "class": cls(c)}, show(r[c]))); });
      if (open) tr.addEventListener("click", function () { open(r.index); });
      frag.appendChild(tr);
    });
    tbody.appendChild(frag);
    if (d.empty && d.empty.length) {
      sec.appendChild(el("p", {"class": "fields", id: "empty-columns" + suffix}, "columns hidden (no value in any trajectory): " + d.empty.join(", ")));
    }
    sec.appendChild(table);
    app.appendChild(sec);
    var state = {key: null, dir: 1};
    head.addEventListener("click", function (ev) {
      var th = ev.target.closest("th"); if (!th) return;
      var key = th.getAttribute("data-key");
      state.dir = state.key === key ? -state.dir : 1; state.key = key;
      head.querySelectorAll("th").forEach(function (h) { h.removeAttribute("data-sort"); });
      th.setAttribute("data-sort", state.dir > 0 ? "asc" : "desc");
      var col = d.columns.indexOf(key);
      var rows = Array.prototype.slice.call(tbody.rows);
      rows.sort(function (a, b) {
        return state.dir * cmp(a.cells[col].getAttribute("data-value"), b.cells[col].getAttribute("data-value")) ||
          (Number(a.getAttribute("data-index")) - Number(b.getAttribute("data-index")));
      });
      var f2 = document.createDocumentFragment(); rows.forEach(function (r) { f2.appendChild(r); }); tbody.appendChild(f2);
    });
    filter.addEventListener("input", function () {
      var q = filter.value.trim().toLowerCase();
      Array.prototype.forEach.call(tbody.rows, function (tr) {
        var hit = !q || Array.prototype.some.call(tr.cells, function (td) {
          return td.getAttribute("data-value").toLowerCase().indexOf(q) >= 0 || td.textContent.toLowerCase().indexOf(q) >= 0;
        });
        tr.hidden = !hit;
      });
    });
    function hist(div, key, title, xtitle) {
      var xs = d.rows.map(function (r) { return r[key]; }).filter(function (v) { return v !== null; });
      Plotly.newPlot(div, [{x: xs, type: "histogram"}], {title: {text: title}, height: 240,
        margin: {l: 60, r: 10, t: 36, b: 44}, xaxis: {title: {text: xtitle}}, yaxis: {title: {text: "trajectories"}}}, PLOT);
    }
    hist(hr, "reward", "reward (" + raw(d.fields.reward || "none") + ")", "reward");
    hist(hl, "length", "response length", d.fields.mask ? "response tokens (" + d.fields.mask + ")" : "tokens");
  }

  function stepPage() {
    var split = body.getAttribute("data-split"), step = body.getAttribute("data-step");
    get("/api/step?split=" + enc(split) + "&step=" + enc(step)).then(function (d) {
      app.appendChild(el("p", null, d.rows.length + " trajectories; click a row to open it, a header to sort"));
      stepTable(d, "", function (i) { location.href = "/traj/" + enc(d.split) + "/" + d.step + "/" + i; });
      ready();
    }).catch(fail);
  }

  // ---------------------------------------------------------------- trajectory page
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

  // ---------------------------------------------------------------- diff page
  var STATUS = {identical: "identical", close: "equal within tolerance (or same values, other dtype)",
    differs: "differs", mismatch: "shapes or trajectory counts differ", missing: "in one dump only"};

  function where(f) {  // "step 2, trajectory 1, token 7" of a first divergence
    return "step " + f.step + (f.trajectory !== undefined && f.trajectory !== null ? ", trajectory " + f.trajectory : "") +
      (f.token !== undefined && f.token !== null ? ", token " + f.token : "");
  }

  function diffSummary(d) {
    var s = d.summary, sec = el("section", {id: "diff-summary", "data-differ-fields": s.differ_fields.join(","),
      "data-identical-fields": s.identical_fields.join(","), "data-differ-steps": s.differ_steps});
    var dl = el("dl", {"class": "values"});
    [["dump A", d.a], ["dump B", d.b]].forEach(function (kv) { dl.appendChild(el("dt", null, kv[0])); dl.appendChild(el("dd", null, kv[1])); });
    sec.appendChild(dl);
    var ul = el("ul");
    ul.appendChild(el("li", {"data-what": "steps"}, s.compared + " steps in both dumps: " + s.n_identical + " identical" +
      (s.n_identical ? " (" + s.identical_steps + ")" : "") +
      (s.n_close ? ", " + s.n_close + " equal within tolerance (" + s.close_steps + ")" : "") +
      ", " + s.n_differ + " differ" + (s.n_differ ? " (" + s.differ_steps + ")" : "") + "."));
    if (s.only_a !== "none") ul.appendChild(el("li", {"data-what": "only-a"}, "steps only in dump A: " + s.only_a));
    if (s.only_b !== "none") ul.appendChild(el("li", {"data-what": "only-b"}, "steps only in dump B: " + s.only_b));
    ul.appendChild(el("li", {"data-what": "identical-fields"}, "fields identical at every step: " +
      (s.identical_fields.length ? s.identical_fields.join(", ") : "none")));
    if (s.close_fields.length) ul.appendChild(el("li", {"data-what": "close-fields"}, "fields equal within tolerance: " + s.close_fields.join(", ")));
    ul.appendChild(el("li", {"data-what": "differ-fields"}, "fields that differ: " +
      (s.differ_fields.length ? s.differ_fields.join(", ") : "none")));
    sec.appendChild(ul);
    var bad = d.fields.filter(function (f) { return s.differ_fields.indexOf(f.field) >= 0; });
    if (bad.length) {
      var t = el("table", {id: "diff-fields", "class": "traj-table"}), head = el("tr");
      ["field", "what", "steps that differ", "values beyond tolerance", "largest |A - B|", "first difference", "A", "B"].forEach(function (h) {
        head.appendChild(el("th", {"class": "text"}, h));
      });
      var thead = el("thead"); thead.appendChild(head); t.appendChild(thead);
      var tb = el("tbody");
      bad.forEach(function (f) {
        var tr = el("tr", {"data-field": f.field, "data-status": f.status}), fst = f.first || {};
        [f.field, STATUS[f.status] || f.status, f.differ_steps, f.n ? f.n_exceed + " of " + f.n : "",
          f.max_abs === null || f.max_abs === undefined ? "" : show(f.max_abs), f.first ? where(fst) + (fst.note ? " (" + fst.note + ")" : "") : "",
          fst.a === undefined ? "" : typeof fst.a === "object" ? JSON.stringify(fst.a) : fst.a,
          fst.b === undefined ? "" : typeof fst.b === "object" ? JSON.stringify(fst.b) : fst.b].forEach(function (v, i) {
          tr.appendChild(el("td", {"class": "text", "data-col": i}, v));
        });
        tb.appendChild(tr);
      });
      t.appendChild(tb);
      sec.appendChild(t);
    }
    app.appendChild(sec);
  }

  function diffPage() {
    get("/api/diff").then(function (d) {
      var f = d.first;
      diffSummary(d);
      var div = el("div", {id: "divergence", "data-step": f ? raw(f.step) : "", "data-field": f ? raw(f.field) : "",
        "data-index": f ? raw(f.trajectory) : "", "data-token": f ? raw(f.token) : ""});
      div.appendChild(el("h2", null, f ? "first difference: " + (f.field === "*" ? "step " + f.step + " is in one dump only" :
        "field " + f.field + ", " + where(f) + " (" + (STATUS[f.status] || f.status) + ")") : "the dumps are identical"));
      if (f) {
        var dl = el("dl", {"class": "values"});
        [["dump A", f.a], ["dump B", f.b], ["note", f.note]].forEach(function (kv) {
          if (kv[1] === undefined) return;
          dl.appendChild(el("dt", null, kv[0])); dl.appendChild(el("dd", {"class": "side"}, typeof kv[1] === "object" ? JSON.stringify(kv[1]) : kv[1]));
        });
        div.appendChild(dl);
      }
      app.appendChild(div);
      ["a", "b"].forEach(function (side) {
        var toks = d["tokens_" + side];
        if (!toks) return;
        app.appendChild(el("h2", null, "trajectory " + f.trajectory + " of step " + f.step + " in dump " + side.toUpperCase() + " (" + d[side] + ")"));
        var v = tokenView({tokens: toks}, "-" + side, f.token === undefined ? null : f.token);
        var fs = d["token_fields_" + side] || {}, mode = fs.logprob ? "logprob" : "none";
        var key = el("div", {id: "legend-" + side, "class": "legend"});
        app.appendChild(key);
        app.appendChild(v.box);
        legend(key, mode, v.paint(mode), fs, toks);
      });
      ready();
    }).catch(fail);
  }

  // ---------------------------------------------------------------- an exported file
  function exportPage() {
    var missing = [];
    DATA.runs.forEach(function (d) { missing = missing.concat(runSplit(d, false).missing); });
    missingList(missing);
    DATA.steps.forEach(function (d) {
      app.appendChild(el("h2", null, "split " + d.split + " step " + d.step));
      stepTable(d, "-" + d.split + "-" + d.step, function (i) { location.hash = "traj-" + d.split + "-" + d.step + "-" + i; });
    });
    DATA.trajs.forEach(function (d) {
      app.appendChild(el("h2", null, "split " + d.split + " step " + d.step + " trajectory " + d.index));
      trajView(d, "-" + d.split + "-" + d.step + "-" + d.index);
    });
    ready();
  }

  var page = body.getAttribute("data-page");
  try {
    if (DATA) exportPage();
    else if (page === "run") runPage();
    else if (page === "step") stepPage();
    else if (page === "traj") trajPage();
    else if (page === "diff") diffPage();
  } catch (e) { fail(e); }
})();
