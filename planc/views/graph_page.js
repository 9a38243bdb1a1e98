"use strict";
// The communication graph page: lanes per pipeline stage (or one rank's), groups that
// expand and collapse, search that goes to what it finds, and a panel of facts.
// Everything it draws comes from the JSON that planc/views/html.py embeds.
(() => {
  const D = JSON.parse(document.getElementById("data").textContent);
  const G = D.geometry;
  const mesh = Mesh(D.mesh, D.rules);
  const SVGNS = "http://www.w3.org/2000/svg";
  const MIN_FIT_SCALE = 0.85;  // 11 px labels stay at least 9 px tall: fit never goes lower
  const $ = id => document.getElementById(id);
  const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
  const clip = (s, n) => s.length <= n ? s : s.slice(0, n - 1) + "\u2026";

  const state = {open: new Set(D.expanded), transfersOnly: false, rank: null, selected: null,
                 selectedGroup: null, view: {x: 0, y: 0, k: 1}};
  let L = null;  // the current placement (Layout.place)
  let shown = [];  // the groups drawn, as placement items

  const nodes = D.nodes, groups = D.groups;
  for (const [i, n] of nodes.entries()) n.index = i;
  const haystack = nodes.map(n => [n.id, ...n.lines, n.axis || "", groups[n.g].title,
    `stage ${n.stage}`, n.layer === null ? "" : `layer ${n.layer} L${n.layer}`,
    ...(n.params || []).map(p => p[0])].join(" ").toLowerCase());

  // --- what is drawn --------------------------------------------------------------------
  function rankStage() { return state.rank === null ? null : mesh.coords(state.rank).pp; }

  function items() {
    const stage = rankStage();
    const out = [];
    for (const [gi, g] of groups.entries()) {
      if (stage !== null && g.stage !== stage) continue;
      const inner = state.transfersOnly ? g.tinner : g.inner;
      if (state.transfersOnly && inner[2].length === 0) continue;
      out.push({g, gi, inner, lines: (state.transfersOnly ? g.tlines : g.lines).length,
                open: state.open.has(g.key)});
    }
    return out;
  }

  function edgeList() {
    const source = state.transfersOnly ? D.tedges : D.edges;
    const visibleGroup = new Map(shown.map(it => [it.gi, it]));
    const next = new Map();  // group -> the next group of its lane
    const last = new Map();
    for (const it of shown) {
      if (last.has(it.g.stage)) next.set(last.get(it.g.stage), it.gi);
      last.set(it.g.stage, it.gi);
    }
    const seen = new Set(), out = [];
    for (const [u, v, saved] of source) {
      const gu = nodes[u].g, gv = nodes[v].g;
      if (!visibleGroup.has(gu) || !visibleGroup.has(gv)) continue;
      const sameLane = groups[gu].stage === groups[gv].stage;
      if (gu !== gv && (saved || (sameLane && next.get(gu) !== gv))) continue;
      const relation = gu === gv ? "inner" : sameLane ? "lane" : "cross";
      const a = relation !== "lane" && L.nodes.has(u) ? `n${u}` : `g${gu}`;
      const b = relation !== "lane" && L.nodes.has(v) ? `n${v}` : `g${gv}`;
      if (a === b || seen.has(a + ">" + b)) continue;
      seen.add(a + ">" + b);
      out.push({a, b, relation, saved: !!saved, from: u, to: v,
                gap: groups[gv].stage > groups[gu].stage ? L.laneOf.get(groups[gv].stage).y
                  : L.laneOf.get(groups[gv].stage).y + L.laneOf.get(groups[gv].stage).h});
    }
    return out;
  }

  function box(ref) {
    if (ref[0] === "n") {
      const [x, y] = L.nodes.get(+ref.slice(1));
      return {x, y, w: G.nodeW, h: G.nodeH};
    }
    const b = L.boxes.get(groups[+ref.slice(1)].key);
    return {x: b.x, y: b.y, w: b.w, h: b.h};
  }

  function nodeSvg(n, x, y) {
    const cls = ["node", n.t === "t" ? "transfer" : "compute"];
    if (n.recompute) cls.push("recompute");
    if (state.selected === n.index) cls.push("selected");
    const colour = n.t === "t" ? n.stroke : "#1f2933";
    const texts = n.lines.map((line, j) =>
      `<text x="${G.nodeW / 2}" y="${15 + 14 * j}" text-anchor="middle" fill="${colour}"` +
      `${j === 0 ? ' font-weight="bold"' : ""}>${esc(clip(line, 30))}</text>`).join("");
    return `<g class="${cls.join(" ")}" data-node="${n.index}" transform="translate(${x},${y})">` +
      `<title>${esc(n.lines.join("\n"))}</title>` +
      `<rect width="${G.nodeW}" height="${G.nodeH}" rx="6" fill="${n.fill}" stroke="${n.stroke}"/>` +
      texts + "</g>";
  }

  function draw() {
    shown = items();
    L = Layout.place(shown, G);
    const out = [];
    const width = Math.max(L.width, 900);
    for (const [i, lane] of L.lanes.entries())
      out.push(`<rect class="lane" x="0" y="${lane.y}" width="${width}" height="${lane.h}" ` +
               `fill="${i % 2 ? "#eef2f6" : "#f7f9fb"}"/>`);
    for (const it of shown) {
      const b = L.boxes.get(it.g.key);
      if (!it.g.boxed) continue;
      const cls = ["frame", b.open ? "open" : "card"];
      if (state.selectedGroup === it.gi) cls.push("selected");
      const lines = b.open ? [] : (state.transfersOnly ? it.g.tlines : it.g.lines).map((line, j) =>
        `<text class="count" x="${G.pad}" y="${G.titleH + G.lineH * j + 8}">${esc(line)}</text>`);
      const fill = b.open ? "#fff" : (D.phaseFills[it.g.phase] || "#fff");
      out.push(`<g class="${cls.join(" ")}" data-group="${it.gi}" transform="translate(${b.x},${b.y})">` +
        `<rect class="box" width="${b.w}" height="${b.h}" rx="8" style="fill:${fill}"/>` +
        `<text class="title" x="${G.pad}" y="17">${b.open ? "\u25be" : "\u25b8"} ${esc(it.g.title)}</text>` +
        lines.join("") + "</g>");
    }
    for (const e of edgeList()) {
      const cls = ["edge", e.relation];
      if (e.saved) cls.push("saved");
      if (state.selected !== null && (e.from === state.selected || e.to === state.selected))
        cls.push("lit");
      const marker = cls.includes("lit") ? "arrowLit" : e.relation === "cross" ? "arrowPP" : "arrow";
      out.push(`<path class="${cls.join(" ")}" d="${Layout.edgePath(box(e.a), box(e.b), e.relation, e.gap)}" ` +
               `marker-end="url(#${marker})"/>`);
    }
    for (const [index, [x, y]] of L.nodes) out.push(nodeSvg(nodes[index], x, y));
    $("world").innerHTML = out.join("");
    drawLaneLabels();
    applyView();
  }

  function laneLines(stage) {
    if (state.rank === null) return D.lanes[String(stage)] || [`stage ${stage}`];
    const c = mesh.coords(state.rank);
    return [`rank ${state.rank}`, `stage ${stage} \u00b7 node ${mesh.nodeOf(state.rank)}`,
            Object.keys(D.mesh.sizes).filter(a => a !== "pp" && D.mesh.sizes[a] > 1)
              .map(a => `${a} ${c[a]}`).join(" \u00b7 ")];
  }

  function drawLaneLabels() {
    const out = [];
    for (const lane of L.lanes) {
      out.push(`<rect x="0" y="${lane.y}" width="${G.laneLabelW - 8}" height="${lane.h}" fill="#ffffffd9"/>`);
      laneLines(lane.stage).forEach((line, j) => line && out.push(
        `<text class="${j === 0 ? "name" : ""}" x="12" y="${lane.y + 24 + 15 * j}">${esc(line)}</text>`));
    }
    $("laneLabels").innerHTML = `<g class="laneLabel">${out.join("")}</g>`;
  }

  function applyView() {
    const {x, y, k} = state.view;
    $("world").setAttribute("transform", `translate(${x},${y}) scale(${k})`);
    $("laneLabels").setAttribute("transform", `translate(0,${y}) scale(${k})`);
  }

  // --- moving around --------------------------------------------------------------------
  function fit() {
    const r = $("canvas").getBoundingClientRect();
    const k = Math.max(MIN_FIT_SCALE, Math.min(1, r.width / L.width, r.height / L.height));
    state.view = {x: 0, y: 0, k};
    applyView();
  }

  function centreOn(x, y, w, h) {
    const r = $("canvas").getBoundingClientRect();
    const k = Math.max(state.view.k, 0.9);
    state.view = {k, x: r.width / 2 - (x + w / 2) * k, y: r.height / 2 - (y + h / 2) * k};
    applyView();
  }

  const canvas = $("canvas");
  let drag = null;
  canvas.addEventListener("mousedown", ev => {
    drag = {x: ev.clientX, y: ev.clientY, vx: state.view.x, vy: state.view.y, moved: false};
  });
  window.addEventListener("mousemove", ev => {
    if (!drag) return;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) { drag.moved = true; canvas.classList.add("dragging"); }
    state.view.x = drag.vx + dx;
    state.view.y = drag.vy + dy;
    applyView();
  });
  window.addEventListener("mouseup", () => { canvas.classList.remove("dragging"); setTimeout(() => { drag = null; }); });
  canvas.addEventListener("wheel", ev => {
    ev.preventDefault();
    const r = canvas.getBoundingClientRect();
    const px = ev.clientX - r.left, py = ev.clientY - r.top;
    const k = Math.min(3, Math.max(0.1, state.view.k * Math.exp(-ev.deltaY / 500)));
    const wx = (px - state.view.x) / state.view.k, wy = (py - state.view.y) / state.view.k;
    state.view = {k, x: px - wx * k, y: py - wy * k};
    applyView();
  }, {passive: false});

  canvas.addEventListener("click", ev => {
    if (drag && drag.moved) return;
    const nodeEl = ev.target.closest("[data-node]");
    if (nodeEl) { select(+nodeEl.dataset.node, false); return; }
    const frame = ev.target.closest("[data-group]");
    if (frame) {
      const gi = +frame.dataset.group, key = groups[gi].key;
      if (state.open.has(key)) state.open.delete(key); else state.open.add(key);
      state.selected = null;
      state.selectedGroup = gi;
      draw();
      groupPanel(gi);
    }
  });

  // --- the panel ------------------------------------------------------------------------
  function table(rows, cls) {
    return `<table${cls ? ` class="${cls}"` : ""}>` + rows.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("") + "</table>";
  }

  function stageRanks(stage) {
    const out = [];
    for (let r = 0; r < mesh.world; r++) if (mesh.coords(r).pp === stage) out.push(r);
    return out;
  }

  function ranksText(list) {
    if (list.length <= 8) return list.join(", ");
    return `${list.slice(0, 6).join(", ")}, \u2026 ${list[list.length - 1]} (${list.length} ranks)`;
  }

  function membersHtml(n) {
    const rank = state.rank !== null ? state.rank : stageRanks(n.stage)[0];
    const members = mesh.groupOf(n, rank);
    if (!members.length) return "";
    const seen = state.rank !== null ? `rank ${rank}` : `rank ${rank}, the stage's first`;
    return `<h3>Its ranks, seen from ${esc(seen)}</h3>` + table([
      ["members", ranksText(members)], ["count", String(members.length)],
      ["placement", mesh.placement(members)]]);
  }

  function select(index, move) {
    const n = nodes[index];
    state.selected = index;
    state.selectedGroup = null;
    if (move) {
      if (state.transfersOnly && n.t !== "t") { state.transfersOnly = false; $("transfersOnly").checked = false; }
      if (state.rank !== null && mesh.coords(state.rank).pp !== n.stage) setRank(null);
      state.open.add(groups[n.g].key);
    }
    draw();
    if (move) { const [x, y] = L.nodes.get(index); centreOn(x, y, G.nodeW, G.nodeH); }
    const colour = n.t === "t" ? n.stroke : "#6b7b8c";
    let body = `<h2>${esc(n.id)}</h2><div class="kindline"><span class="swatch" style="background:${n.fill};border-color:${colour}"></span>` +
      `${esc(n.lines[0])}</div>`;
    if (n.t === "t") body += `<div class="reason"><b>Why it exists:</b> ${esc(D.strings[n.reason])}</div>`;
    body += table(n.rows);
    if (n.params && n.params.length) {
      body += `<h3>Parameters it carries (${n.params.length})</h3>` + table(n.params, "params");
    }
    if (n.t === "t") body += membersHtml(n);
    body += `<p>In group <a href="#" data-open-group="${n.g}">${esc(groups[n.g].title)}</a> of stage ${n.stage}.</p>`;
    $("panel").innerHTML = body;
    history.replaceState(null, "", "#node=" + encodeURIComponent(n.id));
  }

  function groupPanel(gi) {
    const g = groups[gi];
    const transfers = nodes.filter(n => n.g === gi && n.t === "t");
    let body = `<h2>${esc(g.title)}</h2><div class="kindline">stage ${g.stage} \u00b7 ` +
      `${state.open.has(g.key) ? "expanded" : "collapsed"}</div>` + table(g.lines.map(l => {
        const i = l.indexOf(": "); return i < 0 ? ["", l] : [l.slice(0, i), l.slice(i + 2)]; }));
    if (transfers.length) {
      body += `<h3>Its transfers (${transfers.length})</h3><ol class="list">` +
        transfers.map(n => `<li><a href="#" data-go="${n.index}">${esc(n.lines[0])}</a> <small>${esc(n.lines.slice(1).join(" \u00b7 "))}</small></li>`).join("") + "</ol>";
    }
    $("panel").innerHTML = body;
  }

  $("panel").addEventListener("click", ev => {
    const go = ev.target.closest("[data-go]");
    if (go) { ev.preventDefault(); select(+go.dataset.go, true); return; }
    const open = ev.target.closest("[data-open-group]");
    if (open) { ev.preventDefault(); groupPanel(+open.dataset.openGroup); }
  });

  // --- search ---------------------------------------------------------------------------
  const search = $("search"), results = $("results");
  let found = [], active = 0;

  function find(query) {
    const words = query.toLowerCase().split(/\s+/).filter(Boolean);
    if (!words.length) return [];
    const hits = [];
    for (const [i, text] of haystack.entries()) {
      if (words.every(w => text.includes(w))) hits.push(i);
    }
    // Transfers first, then by how early the words occur in the label.
    const score = i => (nodes[i].t === "t" ? 0 : 1000) + haystack[i].indexOf(words[0]);
    return hits.sort((a, b) => score(a) - score(b) || a - b);
  }

  function showResults() {
    const shownHits = found.slice(0, 50);
    results.innerHTML = shownHits.map((i, j) => {
      const n = nodes[i];
      return `<li data-hit="${i}" class="${j === active ? "active" : ""}">${esc(n.lines[0])}` +
        `<small>${esc(n.lines.slice(1).join(" \u00b7 "))} \u00b7 stage ${n.stage} \u00b7 ${esc(groups[n.g].title)}</small></li>`;
    }).join("") + (found.length > 50 ? `<li class="note">${found.length - 50} more: add words to narrow</li>` : "") +
      (!found.length && search.value.trim() ? `<li class="note">nothing matches</li>` : "");
    results.hidden = !search.value.trim();
  }

  function pick(i) {
    results.hidden = true;
    select(i, true);
  }

  search.addEventListener("input", () => { found = find(search.value); active = 0; showResults(); });
  search.addEventListener("keydown", ev => {
    if (ev.key === "ArrowDown" || ev.key === "ArrowUp") {
      ev.preventDefault();
      const count = Math.min(found.length, 50);
      if (count) active = (active + (ev.key === "ArrowDown" ? 1 : count - 1)) % count;
      showResults();
    } else if (ev.key === "Enter" && found.length) {
      ev.preventDefault();
      pick(found[active]);
    } else if (ev.key === "Escape") {
      search.value = ""; found = []; showResults(); search.blur();
    }
  });
  results.addEventListener("mousedown", ev => {
    const li = ev.target.closest("[data-hit]");
    if (li) { ev.preventDefault(); pick(+li.dataset.hit); }
  });
  search.addEventListener("blur", () => { results.hidden = true; });
  search.addEventListener("focus", () => { if (search.value.trim()) showResults(); });
  window.addEventListener("keydown", ev => {
    if (ev.key === "/" && document.activeElement !== search && document.activeElement.tagName !== "INPUT") {
      ev.preventDefault(); search.focus();
    }
  });

  // --- controls ---------------------------------------------------------------------------
  $("transfersOnly").addEventListener("change", ev => {
    state.transfersOnly = ev.target.checked;
    if (state.transfersOnly && state.selected !== null && nodes[state.selected].t !== "t") state.selected = null;
    draw();
  });
  function setRank(value) {
    const input = $("rank");
    if (value === null || value === "" || !Number.isInteger(+value) || +value < 0 || +value >= mesh.world) {
      state.rank = null;
      input.value = "";
      input.title = `0..${mesh.world - 1}; empty: every stage`;
    } else {
      state.rank = +value;
    }
  }
  $("rank").max = String(mesh.world - 1);
  $("rank").addEventListener("change", ev => {
    setRank(ev.target.value);
    if (state.selected !== null && state.rank !== null && nodes[state.selected].stage !== rankStage()) state.selected = null;
    draw();
    fit();
    if (state.selected !== null) select(state.selected, false);
  });
  $("expandAll").addEventListener("click", () => { for (const g of groups) state.open.add(g.key); draw(); });
  $("collapseAll").addEventListener("click", () => { state.open.clear(); draw(); fit(); });
  $("fit").addEventListener("click", fit);

  const axes = Object.entries(D.counts.axes).map(([a, c]) =>
    `<span class="axis" title="transfers over ${esc(a)}"><span class="swatch" style="border-color:${D.axisColors[a] || "#333"}"></span>${esc(a)} ${c}</span>`);
  $("axes").innerHTML = axes.join(" ");
  $("counts").textContent = `${D.counts.nodes.toLocaleString("en")} nodes, ${D.counts.transfers.toLocaleString("en")} transfers \u00b7 ${mesh.world} ranks`;

  draw();
  fit();
  const wanted = decodeURIComponent((location.hash.match(/^#node=(.*)$/) || [])[1] || "");
  const start = nodes.find(n => n.id === wanted);
  if (start) select(start.index, true);
  window.plancGraph = {state, nodes, groups, data: D, layout: () => L, select, find, draw, fit, setRank};
})();
