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
  function curve(div, d, m, fresh) {
    var trace = [{x: d.steps, y: d.series[m], type: "scatter", mode: d.steps.length > 300 ? "lines" : "lines+markers",
      hovertemplate: "step %{x}<br>%{y}<extra></extra>"}];
    var layout = {title: {text: TITLES[m] || m}, height: 250, margin: {l: 50, r: 10, t: 36, b: 36},
      xaxis: {title: {text: "step"}}};
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
    d.columns.forEach(function (c) { head.appendChild(el("th", {"data-key": c}, c)); });
    thead.appendChild(head); table.appendChild(thead); table.appendChild(tbody);
    var frag = document.createDocumentFragment();
    d.rows.forEach(function (r) {
      var tr = el("tr", {"data-index": r.index});
      d.columns.forEach(function (c) { tr.appendChild(el("td", {"data-key": c, "data-value": raw(r[c])}, show(r[c]))); });
      if (open) tr.addEventListener("click", function () { open(r.index); });
      frag.appendChild(tr);
    });
    tbody.appendChild(frag);
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
    function hist(div, key, title) {
      var xs = d.rows.map(function (r) { return r[key]; }).filter(function (v) { return v !== null; });
      Plotly.newPlot(div, [{x: xs, type: "histogram"}], {title: {text: title}, height: 240,
        margin: {l: 40, r: 10, t: 36, b: 30}}, PLOT);
    }
    hist(hr, "reward", "reward (" + raw(d.fields.reward || "none") + ")");
    hist(hl, "length", "response length");
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
  function colour(t, mode, maxv) {
    if (t.mask === 0) return MASKED;
    if (mode === "logprob") {
      var x = t.logprob === "-inf" ? -Infinity : Number(t.logprob);
      if (t.logprob === "" || isNaN(x)) return WHITE;
      var p = Math.min(1, Math.max(0, Math.exp(x))), g = Math.round(255 * p);
      return "rgb(255, " + g + ", " + g + ")";
    }
    if (mode === "diff") {
      if (t.logprob === "" || t.other === undefined || t.other === "") return WHITE;
      var dd = Math.min(Math.abs(Number(t.logprob) - Number(t.other)), 1);
      if (isNaN(dd)) return WHITE;
      var h = Math.round(255 * (1 - dd));
      return "rgb(255, " + h + ", " + h + ")";
    }
    if (t.version === "") return WHITE;
    return PALETTE[(((maxv - Number(t.version)) % 8) + 8) % 8];
  }

  function tokenSpan(t, j) {
    var a = {"class": "tok", "data-pos": j, "data-id": t.id, "data-logprob": t.logprob, "data-mask": t.mask,
      "data-version": t.version, title: t.title};
    if (t.other !== undefined) a["data-other"] = t.other;
    return el("span", a, t.text);
  }

  function tokenView(d, suffix, diverge) {
    var toks = d.tokens, maxv = null;
    toks.forEach(function (t) { if (t.version !== "" && (maxv === null || Number(t.version) > maxv)) maxv = Number(t.version); });
    var box = el("div", {id: "tokens" + suffix, "class": "tokens"});
    var frag = document.createDocumentFragment(), seg = null, spans = [];
    toks.forEach(function (t, j) {
      if (seg === null || Number(seg.getAttribute("data-mask")) !== t.mask) {
        var kind = t.mask === 1 ? "response" : (j === 0 ? "prompt" : "turn");
        seg = el("div", {"class": "segment", "data-kind": kind, "data-mask": t.mask});
        frag.appendChild(seg);
      }
      var s = tokenSpan(t, j);
      if (diverge === j) s.classList.add("diverge");
      spans.push(s);
      seg.appendChild(s);
    });
    box.appendChild(frag);
    function paint(mode) { spans.forEach(function (s, j) { s.style.backgroundColor = colour(toks[j], mode, maxv); }); }
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
    var sel = el("select", {id: "colour" + suffix});
    ["logprob", "diff", "version"].forEach(function (m) { sel.appendChild(el("option", {value: m}, "colour by " + m)); });
    sec.appendChild(sel);
    var v = tokenView(d, suffix, null);
    sec.appendChild(v.box);
    app.appendChild(sec);
    v.paint(sel.value);
    sel.addEventListener("change", function () { v.paint(sel.value); });
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
  function diffPage() {
    get("/api/diff").then(function (d) {
      var f = d.first;
      var div = el("div", {id: "divergence", "data-step": f ? raw(f.step) : "", "data-field": f ? raw(f.field) : "",
        "data-index": f ? raw(f.trajectory) : "", "data-token": f ? raw(f.token) : ""});
      div.appendChild(el("p", null, f ? "first divergence: step " + f.step + ", field " + f.field +
        (f.trajectory !== undefined ? ", trajectory " + f.trajectory : "") +
        (f.token !== undefined ? ", token " + f.token : "") + " (" + f.status + ")" : "the dumps agree"));
      if (f) {
        var dl = el("dl", {"class": "values"});
        [["a: " + d.a, f.a], ["b: " + d.b, f.b], ["note", f.note]].forEach(function (kv) {
          if (kv[1] === undefined) return;
          dl.appendChild(el("dt", null, kv[0])); dl.appendChild(el("dd", {"class": "side"}, typeof kv[1] === "object" ? JSON.stringify(kv[1]) : kv[1]));
        });
        div.appendChild(dl);
      }
      app.appendChild(div);
      ["a", "b"].forEach(function (side) {
        var toks = d["tokens_" + side];
        if (!toks) return;
        app.appendChild(el("h2", null, "trajectory " + f.trajectory + " of step " + f.step + " in " + d[side]));
        var v = tokenView({tokens: toks}, "-" + side, f.token === undefined ? null : f.token);
        app.appendChild(v.box);
        v.paint("logprob");
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
