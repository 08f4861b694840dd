/* trajstore view, the step page: one step's trajectories as a table (sorted by a click on a header,
   filtered by text or number), with histograms of reward and response length. */
(function (V) {
  "use strict";
  var body = V.body, app = V.app, el = V.el, get = V.get, enc = V.enc, raw = V.raw, show = V.show,
    PLOT = V.PLOT, ready = V.ready, fail = V.fail;

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

  V.stepTable = stepTable;
  V.stepPage = stepPage;
})(window.trajstoreView);
