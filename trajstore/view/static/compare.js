/* trajstore view A B: two runs side by side (trajstore/view/compare.py, docs/PRECISION.md). On the run
   page, both runs' curves overlaid (a legend names the runs); on the diff page, every field beyond
   tolerance per step, each opening its worst trajectory of both runs aligned by its id; on the aligned
   page, one field token by token in both runs, coloured by |a - b| on a scale fitted to the data, with
   its legend. Loaded last, it uses the helpers of common.js. Dump data is only ever set with textContent or
   setAttribute. */
(function (V) {
  "use strict";
  var body = V.body, app = V.app, el = V.el, get = V.get, enc = V.enc, PLOT = V.PLOT;
  if (!app || document.getElementById("trajstore-data")) return;  // an exported file: one run
  var COLOURS = ["rgb(31, 119, 180)", "rgb(255, 127, 14)"];
  var LOW = [255, 255, 255], HIGH = [203, 24, 29];  // |a - b| = 0 .. the largest difference shown

  function num(v) { return V.prec(v, 4, "-"); }
  function done(sec, e) {
    if (e) V.error(sec, "compare-error", e);
    body.setAttribute("data-compare-ready", "1");
  }
  function idText(id) { return id ? "(" + id[0] + ", " + id[1] + ")" : "-"; }

  // the colour of a difference on the scale [0, hi] fitted to the data
  function shade(d, hi) {
    if (d === null || d === undefined || typeof d !== "number") return "rgb(235, 235, 235)";
    var t = hi > 0 ? Math.min(d / hi, 1) : 0;
    var c = LOW.map(function (lo, k) { return Math.round(lo + t * (HIGH[k] - lo)); });
    return "rgb(" + c.join(", ") + ")";
  }

  // ------------------------------------------------------------ run page: both runs overlaid
  function overlay() {
    var sec = el("section", {id: "overlay", "class": "overlay"});
    app.insertBefore(sec, app.firstChild);
    var split = body.getAttribute("data-split");
    get("/api/compare/run?split=" + enc(split)).then(function (d) {
      sec.appendChild(el("h2", null, "both runs, split " + d.split + ": " + d.runs[0] + " and " + d.runs[1]));
      var grid = el("div", {"class": "grid"});
      sec.appendChild(grid);
      Object.keys(d.series).forEach(function (m) {
        var div = el("div", {id: "overlay-" + m, "class": "curve", "data-metric": m});
        grid.appendChild(div);
        var traces = d.series[m].map(function (ys, k) {
          return {x: d.steps, y: ys, name: d.runs[k], type: "scatter", mode: "lines+markers",
            line: {color: COLOURS[k], dash: k ? "dot" : "solid"}, marker: {color: COLOURS[k]},
            hovertemplate: d.runs[k] + "<br>step %{x}<br>%{y}<extra></extra>"};
        });
        Plotly.newPlot(div, traces, {title: {text: m + " (mean per step)"}, height: 260, showlegend: true,
          legend: {orientation: "h", y: -0.3}, margin: {l: 55, r: 10, t: 36, b: 60},
          xaxis: {title: {text: "step"}}, yaxis: {title: {text: m}}}, PLOT);
      });
      done(sec);
    }).catch(function (e) { done(sec, e); });
  }

  // ------------------------------------------------------------ diff page: every diverging field
  function diverging() {
    var sec = el("section", {id: "diverging", "class": "diverging"});
    app.appendChild(sec);
    var q = new URLSearchParams(location.search);
    var split = q.get("split") || "";
    get("/api/compare/diff" + (split ? "?split=" + enc(split) : "")).then(function (d) {
      var bad = Object.keys(d.fields).filter(function (k) { return ["identical", "close"].indexOf(d.fields[k].status) < 0; });
      sec.appendChild(el("h2", null, bad.length ? bad.length + " field(s) beyond tolerance: " + bad.join(", ") :
        "every field within tolerance"));
      var ul = el("ul", {id: "diverging-fields"});
      bad.forEach(function (k) {
        var f = d.fields[k];
        ul.appendChild(el("li", {"data-field": k, "data-status": f.status}, k + ": " + f.status + " on " +
          f.steps + " step(s), max abs " + num(f.max_abs) + ", max rel " + num(f.max_rel)));
      });
      sec.appendChild(ul);
      if (!d.entries.length) return done(sec);
      var t = el("table", {id: "diverging-entries"});
      var head = el("tr");
      ["step", "field", "status", "max abs", "mean abs", "max rel", "mean rel", "worst trajectory", "token",
        "trajectories beyond tolerance"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      t.appendChild(head);
      d.entries.forEach(function (e) {
        var tr = el("tr", {"data-step": e.step, "data-field": e.field, "data-status": e.status});
        [e.step, e.field, e.status, num(e.max_abs), num(e.mean_abs), num(e.max_rel), num(e.mean_rel)].forEach(function (v) {
          tr.appendChild(el("td", null, v));
        });
        var w = e.worst || {}, td = el("td");
        if (w.id) {
          var href = "/aligned/" + enc(d.split) + "/" + w.id[0] + "/" + w.id[1] + "?field=" + enc(e.field);
          td.appendChild(el("a", {href: href, "class": "aligned-link"}, idText(w.id)));
        } else td.textContent = w.trajectory === undefined ? "-" : String(w.trajectory);
        tr.appendChild(td);
        tr.appendChild(el("td", null, w.token === undefined ? "-" : w.token));
        tr.appendChild(el("td", {"class": "beyond"}, (e.beyond || []).map(function (b) {
          return Array.isArray(b) ? idText(b) : String(b); }).join(" ") || e.note || "-"));
        t.appendChild(tr);
      });
      sec.appendChild(t);
      done(sec);
    }).catch(function (e) { done(sec, e); });
  }

  // ------------------------------------------------------------ aligned page: one trajectory of both runs
  function legend(hi, field) {
    var box = el("div", {id: "scale", "class": "scale", "data-min": "0", "data-max": String(hi)});
    box.appendChild(el("span", {"class": "scale-title"}, "|a - b| of " + field + ": "));
    box.appendChild(el("span", {"class": "scale-end", id: "scale-min"}, "0"));
    var bar = el("span", {"class": "scale-bar", id: "scale-bar"});
    bar.style.display = "inline-block"; bar.style.width = "200px"; bar.style.height = "12px";
    bar.style.margin = "0 6px"; bar.style.border = "1px solid #999";
    bar.style.background = "linear-gradient(to right, " + shade(0, 1) + ", " + shade(1, 1) + ")";
    box.appendChild(bar);
    box.appendChild(el("span", {"class": "scale-end", id: "scale-max"}, num(hi)));
    box.appendChild(el("span", {"class": "scale-note"}, hi > 0 ? " (white: equal; darkest: the largest difference)" :
      " (the two runs agree on every token)"));
    return box;
  }

  function alignedPage() {
    var q = new URLSearchParams(location.search), field = q.get("field");
    var url = "/api/compare/traj?split=" + enc(body.getAttribute("data-split")) + "&step=" +
      enc(body.getAttribute("data-step")) + "&row=" + enc(body.getAttribute("data-row")) + (field ? "&field=" + enc(field) : "");
    get(url).then(function (d) {
      var p = el("p"); p.appendChild(el("a", {href: "/diff"}, "back to the diff")); app.appendChild(p);
      app.appendChild(el("p", {id: "aligned-info", "data-field": d.field, "data-index-a": d.index[0], "data-index-b": d.index[1]},
        "trajectory (" + d.step + ", " + d.row + "): row " + d.index[0] + " of " + d.runs[0] + ", row " + d.index[1] +
        " of " + d.runs[1] + "; field " + d.field + ", " + d.tokens.length + " tokens"));
      var hi = d.scale.max === null ? 0 : d.scale.max;
      app.appendChild(legend(hi, d.field));
      ["a", "b"].forEach(function (side, k) {
        app.appendChild(el("h2", null, d.runs[k]));
        var box = el("div", {id: "aligned-" + side, "class": "tokens"});
        d.tokens.forEach(function (t) {
          var s = el("span", {"class": "tok", "data-pos": t.pos, "data-diff": num(t.diff), "data-value": num(t[side]),
            title: "token " + t.pos + " " + t.text + ": " + d.runs[0] + " " + t.a + ", " + d.runs[1] + " " + t.b +
              ", |a - b| " + t.diff}, t.text);
          s.style.backgroundColor = shade(t.diff, hi);
          box.appendChild(s);
        });
        app.appendChild(box);
      });
      done(app);
      V.ready();
    }).catch(function (e) { done(app, e); V.ready(); });
  }

  var page = body.getAttribute("data-page");
  if (page === "run" && body.getAttribute("data-diff") === "1") overlay();
  else if (page === "diff" && body.getAttribute("data-diff") === "1") diverging();
  else if (page === "aligned") alignedPage();
})(window.trajstoreView);
