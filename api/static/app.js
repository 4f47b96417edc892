// docpipe web UI: plain JS against the REST API. The API key lives in localStorage and goes in X-API-Key.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: localStorage.getItem("docpipe.key") || "", selected: null, cursor: null, pageUrl: null };

// ---- API access ------------------------------------------------------------------------------------------------

class ApiProblem extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.code = problem.code || "";
  }
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (state.key) headers.set("X-API-Key", state.key);
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    throw new ApiProblem(0, { detail: `The server cannot be reached (${err.message}).` });
  }
  if (!response.ok) {
    let problem = {};
    try { problem = await response.json(); } catch (_) { /* not JSON: keep the status text */ }
    if (!problem.detail) problem.detail = `${response.status} ${response.statusText}`;
    if (response.status === 429 && response.headers.get("Retry-After")) {
      problem.detail += ` (retry in ${response.headers.get("Retry-After")} s)`;
    }
    throw new ApiProblem(response.status, problem);
  }
  return response;
}

const apiJson = async (path, options) => (await api(path, options)).json();

// ---- messages in words --------------------------------------------------------------------------------------------

function explain(err) {
  if (err instanceof ApiProblem) {
    if (err.status === 401) return "This server needs an API key. Enter it at the top and press 'Use key'.";
    if (err.status === 403) return "The API key was refused. Check it and enter it again.";
    return err.message;
  }
  return String(err);
}

function showBanner(text, ok = false) {
  const banner = $("banner");
  banner.textContent = text;
  banner.classList.toggle("ok", ok);
  banner.classList.remove("hidden");
}

function clearBanner() { $("banner").classList.add("hidden"); }

// ---- key ---------------------------------------------------------------------------------------------------------

function renderKeyState() {
  $("key-state").textContent = state.key ? "key set" : "no key";
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("api-key").value.trim();
  if (state.key) localStorage.setItem("docpipe.key", state.key); else localStorage.removeItem("docpipe.key");
  $("api-key").value = "";
  renderKeyState();
  clearBanner();
  boot();
});

// ---- schemas and upload --------------------------------------------------------------------------------------------

async function loadSchemas() {
  const { items } = await apiJson("/v1/schemas");
  const select = $("schema-select");
  const previous = select.value;
  select.replaceChildren(...items.map((s) => {
    const opt = document.createElement("option");
    opt.value = s.name;
    opt.textContent = `${s.name} (v${s.version}${s.builtin ? "" : ", yours"})`;
    return opt;
  }));
  if (previous) select.value = previous;
  else if (items.some((s) => s.name === "generic")) select.value = "generic";
}

function logUpload(text, cls = "") {
  const li = document.createElement("li");
  li.textContent = text;
  if (cls) li.className = cls;
  $("upload-log").prepend(li);
  return li;
}

async function uploadFile(file) {
  const form = new FormData();
  form.append("file", file, file.name);
  form.append("schema", $("schema-select").value);
  const password = $("pdf-password").value;
  if (password) form.append("password", password);
  const line = logUpload(`${file.name}: uploading…`);
  try {
    const out = await apiJson("/v1/documents", { method: "POST", body: form });
    line.textContent = `${file.name}: ${out.duplicate ? "already here as" : "accepted as"} document ${out.document.id}`;
    line.dataset.docId = out.document.id;
    await refreshList();
    selectDocument(out.document.id);
  } catch (err) {
    line.textContent = `${file.name}: ${explain(err)}`;
    line.className = "error";
  }
}

function uploadAll(files) { for (const f of files) uploadFile(f); }

const zone = $("drop-zone");
zone.addEventListener("dragover", (ev) => { ev.preventDefault(); zone.classList.add("over"); });
zone.addEventListener("dragleave", () => zone.classList.remove("over"));
zone.addEventListener("drop", (ev) => {
  ev.preventDefault();
  zone.classList.remove("over");
  uploadAll(ev.dataTransfer.files);
});
$("file-input").addEventListener("change", (ev) => { uploadAll(ev.target.files); ev.target.value = ""; });

// ---- list ---------------------------------------------------------------------------------------------------------

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function docRow(doc) {
  const tr = document.createElement("tr");
  tr.dataset.docId = doc.id;
  const job = doc.jobs[doc.jobs.length - 1];
  tr.append(
    cell(doc.id),
    cell(doc.name),
    cell(doc.kind || doc.media_type || "?"),
    cell(doc.page_count),
    cell(job ? job.schema : "–"),
    cell(doc.status, `status status-${doc.status}`),
    cell(new Date(doc.created_at).toLocaleString()),
  );
  if (doc.id === state.selected) tr.classList.add("selected");
  tr.addEventListener("click", () => selectDocument(doc.id));
  return tr;
}

async function refreshList() {
  const page = await apiJson("/v1/documents?limit=50");
  $("doc-list").replaceChildren(...page.items.map(docRow));
  state.cursor = page.next_cursor;
  $("more").classList.toggle("hidden", !state.cursor);
}

$("more").addEventListener("click", async () => {
  try {
    const page = await apiJson(`/v1/documents?limit=50&cursor=${encodeURIComponent(state.cursor)}`);
    $("doc-list").append(...page.items.map(docRow));
    state.cursor = page.next_cursor;
    $("more").classList.toggle("hidden", !state.cursor);
  } catch (err) { showBanner(explain(err)); }
});

// ---- detail -------------------------------------------------------------------------------------------------------

function confClass(p) { return p >= 0.8 ? "conf-high" : p >= 0.5 ? "conf-mid" : "conf-low"; }

// Flatten a JSON value into (JSON pointer, scalar) rows; confidences are keyed by the same pointers.
function flatten(value, pointer = "", out = []) {
  if (value !== null && typeof value === "object") {
    const entries = Array.isArray(value) ? value.map((v, i) => [i, v]) : Object.entries(value);
    if (entries.length === 0) out.push([pointer || "/", Array.isArray(value) ? "[]" : "{}"]);
    for (const [k, v] of entries) flatten(v, `${pointer}/${String(k).replace(/~/g, "~0").replace(/\//g, "~1")}`, out);
  } else {
    out.push([pointer || "/", value]);
  }
  return out;
}

function renderFields(unit) {
  const rows = $("field-rows");
  rows.replaceChildren();
  const err = $("unit-error");
  err.classList.add("hidden");
  if (!unit) {
    rows.append(Object.assign(document.createElement("tr"), { innerHTML: "<td colspan=3 class=muted>No result yet.</td>" }));
    return;
  }
  if (!unit.ok) {
    err.textContent = `This part could not be read: ${unit.error || "no reason recorded"}`;
    err.classList.remove("hidden");
    return;
  }
  const fields = (unit.confidence && unit.confidence.fields) || {};
  for (const [pointer, value] of flatten(unit.data)) {
    const tr = document.createElement("tr");
    tr.className = "field-row";
    const p = fields[pointer];
    tr.append(
      cell(pointer.slice(1) || "(value)", "field-name"),
      cell(value === null ? "—" : String(value), "field-value"),
      cell(typeof p === "number" ? p.toFixed(2) : "", typeof p === "number" ? `conf ${confClass(p)}` : "conf"),
    );
    rows.append(tr);
  }
}

async function showPageImage(doc, index) {
  const page = doc.pages.find((p) => p.index === index);
  const img = $("page-image");
  if (state.pageUrl) { URL.revokeObjectURL(state.pageUrl); state.pageUrl = null; }
  img.removeAttribute("src");
  if (!page) { $("page-caption").textContent = "No rendered pages."; return; }
  $("page-caption").textContent = page.error
    ? `Page ${index + 1} could not be rendered: ${page.error}`
    : `${page.kind} ${index + 1} of ${doc.pages.length}` + (page.timestamp != null ? ` at ${page.timestamp.toFixed(1)} s` : "");
  if (!page.image_url) return;
  try {
    // <img> cannot send the key header, so fetch the PNG and show it from a blob URL.
    const blob = await (await api(page.image_url)).blob();
    state.pageUrl = URL.createObjectURL(blob);
    img.src = state.pageUrl;
  } catch (err) { $("page-caption").textContent = explain(err); }
}

let detailTimer = null;

async function selectDocument(id) {
  state.selected = id;
  for (const tr of $("doc-list").children) tr.classList.toggle("selected", Number(tr.dataset.docId) === id);
  clearTimeout(detailTimer);
  try {
    await renderDetail(id, true);
  } catch (err) { showBanner(explain(err)); }
}

async function renderDetail(id, fresh) {
  const doc = await apiJson(`/v1/documents/${id}`);
  if (state.selected !== id) return;
  $("detail").classList.remove("hidden");
  $("detail-title").textContent = `${doc.name} — ${doc.status}`;
  $("detail-title").dataset.status = doc.status;
  const job = doc.jobs[doc.jobs.length - 1];
  $("detail-meta").textContent = `document ${doc.id} · ${doc.media_type || "unknown type"} · ${doc.size_bytes} bytes · ` +
    `${doc.page_count} page(s)` + (job ? ` · schema ${job.schema} v${job.schema_version} · job ${job.id} ${job.state}` : "");
  const problems = [doc.error, job && job.error].filter(Boolean);
  $("detail-error").textContent = problems.join(" — ");
  $("detail-error").classList.toggle("hidden", problems.length === 0);
  $("retry").classList.toggle("hidden", !(job && (job.state === "failed" || job.state === "partial")));
  $("retry").dataset.jobId = job ? job.id : "";

  const pageSelect = $("page-select");
  if (fresh || pageSelect.options.length !== doc.pages.length) {
    pageSelect.replaceChildren(...doc.pages.map((p) => {
      const opt = document.createElement("option");
      opt.value = p.index;
      opt.textContent = `${p.index + 1}`;
      return opt;
    }));
  }
  const index = Number(pageSelect.value || 0);
  if (fresh || !$("page-image").getAttribute("src")) await showPageImage(doc, index);

  let result = null;
  if (job) result = await apiJson(`/v1/documents/${id}/result`);
  const finished = result && ["succeeded", "partial", "failed"].includes(result.state);
  let unit = null;
  if (finished) {
    if ($("view-select").value === "document") unit = result.document;
    else unit = result.units.find((u) => u.page_index === index) || result.units.find((u) => u.unit === "video") || result.document;
  }
  renderFields(unit);
  $("fields").dataset.state = result ? result.state : "none";
  if (!finished && doc.status !== "failed") detailTimer = setTimeout(() => renderDetail(id, false).catch(() => {}), 1000);
}

$("page-select").addEventListener("change", () => state.selected && renderDetail(state.selected, true));
$("view-select").addEventListener("change", () => state.selected && renderDetail(state.selected, false));

$("retry").addEventListener("click", async () => {
  try {
    await apiJson(`/v1/jobs/${$("retry").dataset.jobId}/retry`, { method: "POST" });
    showBanner("Job queued again.", true);
    renderDetail(state.selected, false);
  } catch (err) { showBanner(explain(err)); }
});

$("delete").addEventListener("click", async () => {
  if (!state.selected || !confirm("Delete this document and its results?")) return;
  try {
    await api(`/v1/documents/${state.selected}`, { method: "DELETE" });
    state.selected = null;
    $("detail").classList.add("hidden");
    refreshList();
  } catch (err) { showBanner(explain(err)); }
});

// ---- start --------------------------------------------------------------------------------------------------------

let listTimer = null;

async function boot() {
  clearTimeout(listTimer);
  try {
    await loadSchemas();
    await refreshList();
    clearBanner();
  } catch (err) {
    showBanner(explain(err));
    return;
  }
  const poll = async () => {
    try { await refreshList(); } catch (err) { showBanner(explain(err)); }
    listTimer = setTimeout(poll, 2000);
  };
  listTimer = setTimeout(poll, 2000);
}

renderKeyState();
boot();
