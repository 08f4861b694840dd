/* trajstore view: builds each page from its JSON (/api/... or, in an exported file, the embedded
   <script id="trajstore-data" type="application/json">), with the helpers of common.js and the parts of
   run.js, step.js, tokens.js and diff.js (loaded before this script). Dump data is only ever set with
   textContent or setAttribute, never parsed as HTML. */
(function (V) {
  "use strict";
  var body = V.body, app = V.app, el = V.el;
  var embedded = document.getElementById("trajstore-data");
  var DATA = embedded ? JSON.parse(embedded.textContent) : null;

  // ---------------------------------------------------------------- an exported file
  function exportPage() {
    var missing = [];
    DATA.runs.forEach(function (d) { missing = missing.concat(V.runSplit(d, false).missing); });
    V.missingList(missing);
    DATA.steps.forEach(function (d) {
      app.appendChild(el("h2", null, "split " + d.split + " step " + d.step));
      V.stepTable(d, "-" + d.split + "-" + d.step, function (i) { location.hash = "traj-" + d.split + "-" + d.step + "-" + i; });
    });
    DATA.trajs.forEach(function (d) {
      app.appendChild(el("h2", null, "split " + d.split + " step " + d.step + " trajectory " + d.index));
      V.trajView(d, "-" + d.split + "-" + d.step + "-" + d.index);
    });
    V.ready();
  }

  var page = body.getAttribute("data-page");
  try {
    if (DATA) exportPage();
    else if (page === "run") V.runPage();
    else if (page === "step") V.stepPage();
    else if (page === "traj") V.trajPage();
    else if (page === "diff") V.diffPage();
  } catch (e) { V.fail(e); }
})(window.trajstoreView);
