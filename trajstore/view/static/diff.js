/* trajstore view, the diff page of two dumps: a summary of the steps and fields that differ, a table of
   each differing field, and the first difference with the trajectory's tokens in both dumps. */
(function (V) {
  "use strict";
  var app = V.app, el = V.el, get = V.get, raw = V.raw, show = V.show, ready = V.ready, fail = V.fail;
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
        var v = V.tokenView({tokens: toks}, "-" + side, f.token === undefined ? null : f.token);
        var fs = d["token_fields_" + side] || {}, mode = fs.logprob ? "logprob" : "none";
        var key = el("div", {id: "legend-" + side, "class": "legend"});
        app.appendChild(key);
        app.appendChild(v.box);
        V.legend(key, mode, v.paint(mode), fs, toks);
      });
      ready();
    }).catch(fail);
  }

  V.diffPage = diffPage;
})(window.trajstoreView);
