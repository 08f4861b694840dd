/* trajstore view, the run page: one curve a metric per split (a band of one standard deviation around
   the reward mean, a break at each skipped or incomplete step, a note where a curve has no point), the
   steps still being read polled in, then the list of skipped and incomplete steps. Also drawn, unlinked,
   in an exported file (view.js). */
(function (V) {
  "use strict";
  var body = V.body, app = V.app, el = V.el, get = V.get, enc = V.enc, raw = V.raw, PLOT = V.PLOT,
    ready = V.ready, fail = V.fail;
  var TITLES = {reward_mean: "reward mean", reward_std: "reward std", reward_min: "reward min",
    reward_max: "reward max", length_mean: "response length mean", length_p95: "response length p95",
    tokens: "tokens per step", version_lag: "policy-version lag", logprob_mismatch: "logprob mismatch |a - b|"};
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

  V.runSplit = runSplit;
  V.missingList = missingList;
  V.runPage = runPage;
})(window.trajstoreView);
