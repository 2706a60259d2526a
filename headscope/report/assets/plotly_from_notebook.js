// In a notebook, a page's plotly.js is this instead: it runs the copy the notebook's own page holds, inert, in this
// page's document (headscope/report/notebook.py: one copy per notebook instead of 4.6 MB per result).
(function () {
  var held = null;
  try { held = window.parent.document.getElementById("headscope-plotly"); } catch (error) {}
  if (held) {
    var script = document.createElement("script");
    script.textContent = held.textContent;
    document.head.appendChild(script);
    return;
  }
  window.addEventListener("DOMContentLoaded", function () {
    document.body.insertAdjacentHTML("afterbegin", "<p style='color:#a00'>The charts need plotly.js, which "
      + "headscope sends once, with the first result a kernel shows; this notebook page no longer holds it. Run "
      + "<code>headscope.report.notebook.send_plotly_again()</code>, then this cell again.</p>");
  });
})();
