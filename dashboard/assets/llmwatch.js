/* llmwatch dashboard: page state in the URL, and zoom synced across a page's charts. */
window.llmw = window.llmw || {};

/* Merge `params` into the URL's query (null or "" removes a key) without a reload or
   a re-render: history.replaceState fires no popstate and Dash's Location ignores it. */
window.llmw.setQuery = function (params) {
  const url = new URL(window.location.href);
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined || v === "" || (Array.isArray(v) && v.length === 0)) {
      url.searchParams.delete(k);
    } else {
      url.searchParams.set(k, Array.isArray(v) ? v.join(",") : String(v));
    }
  }
  if (url.href !== window.location.href) {
    window.history.replaceState(window.history.state, "", url.href);
  }
  return window.dash_clientside.no_update;
};

/* Zoom one chart of class llmw-sync and the others follow: the x range of the chart
   that was zoomed goes to every other synced chart of the page, and into the URL
   (`from`/`to`). An autorange (double click) resets them all. Returns the step range
   ({from, to}, null after an autorange) for a page that refetches what it shows. */
window.llmw.lastSync = {key: null, at: 0};
window.llmw.syncZoom = function () {
  const cc = window.dash_clientside.callback_context;
  const trig = cc && cc.triggered;
  if (!trig || trig.length === 0 || !trig[0].value) { return window.dash_clientside.no_update; }
  const ev = trig[0].value;
  let update = null, from = null, to = null;
  if (ev["xaxis.range[0]"] !== undefined) {
    from = ev["xaxis.range[0]"]; to = ev["xaxis.range[1]"];
  } else if (ev["xaxis.range"] !== undefined) {
    from = ev["xaxis.range"][0]; to = ev["xaxis.range"][1];
  }
  if (from !== null) {
    update = {"xaxis.range": [from, to]};
  } else if (ev["xaxis.autorange"]) {
    update = {"xaxis.autorange": true};
  } else {
    return window.dash_clientside.no_update;
  }
  /* the charts this moves report the same range back: apply each range once */
  const key = JSON.stringify(update), now = Date.now();
  if (key === window.llmw.lastSync.key && now - window.llmw.lastSync.at < 1500) {
    return window.dash_clientside.no_update;
  }
  window.llmw.lastSync = {key: key, at: now};
  const sourceId = trig[0].prop_id.split(".relayoutData")[0];
  document.querySelectorAll(".llmw-sync").forEach(function (el) {
    const plot = el.querySelector(".js-plotly-plot");
    if (plot && el.id !== sourceId) { window.Plotly.relayout(plot, update); }
  });
  const fmt = v => (typeof v === "number" ? Math.round(v) : v);
  window.llmw.setQuery(from === null ? {from: null, to: null} : {from: fmt(from), to: fmt(to)});
  /* a step range (not a time range) is what a page refetches at full resolution */
  if (from === null) { return null; }
  return (typeof from === "number") ? {from: Math.floor(from), to: Math.ceil(to)} : window.dash_clientside.no_update;
};

/* ClientsideFunction("llmw", name) looks here */
window.dash_clientside = window.dash_clientside || {};
window.dash_clientside.llmw = {syncZoom: window.llmw.syncZoom};
