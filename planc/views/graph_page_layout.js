"use strict";
// Placement of groups in lanes, edge paths and the mesh's group table, for graph_page.js.
// place() is planc/views/graph/positions.py's place() and edgePath() graph_svg.py's
// edge_path(): the page's first view and the SVG agree (tests/test_graph_page.py checks).
const Layout = (() => {
  function groupSize(item, G) {
    const [w, h] = item.inner;
    if (!item.g.boxed) return [G.nodeW, G.nodeH];
    if (item.open) return [Math.max(w, G.cardW - 2 * G.pad) + 2 * G.pad, G.titleH + h + 2 * G.pad];
    return [G.cardW, G.titleH + item.lines * G.lineH + G.pad];
  }

  // items: [{g, inner: [w, h, [[node, x, y], ...]], lines, open}] in the order stages run them.
  function place(items, G) {
    const stages = [...new Set(items.map(it => it.g.stage))].sort((a, b) => a - b);
    const laneEnd = new Map(stages.map(s => [s, G.laneLabelW + G.groupGap]));
    const boxes = new Map(), nodes = new Map(), lanes = [];
    for (const it of items) {
      const [w, h] = groupSize(it, G), x = laneEnd.get(it.g.stage);
      boxes.set(it.g.key, {x, y: 0, w, h, open: it.open || !it.g.boxed, item: it});
      laneEnd.set(it.g.stage, x + w + G.groupGap);
    }
    let y = 0;
    for (const stage of stages) {
      const height = Math.max(...items.filter(it => it.g.stage === stage)
        .map(it => boxes.get(it.g.key).h)) + 2 * G.lanePad;
      lanes.push({stage, y, h: height});
      y += height;
    }
    const laneY = new Map(lanes.map(l => [l.stage, l]));
    for (const it of items) {
      const box = boxes.get(it.g.key);
      box.y = laneY.get(it.g.stage).y + G.lanePad;
      if (!box.open) continue;
      const dx = it.g.boxed ? box.x + G.pad : box.x, dy = it.g.boxed ? box.y + G.titleH + G.pad : box.y;
      for (const [node, x, yy] of it.inner[2]) nodes.set(node, [dx + x, dy + yy]);
    }
    const width = Math.max(G.laneLabelW, ...laneEnd.values()) + G.groupGap;
    return {lanes, laneOf: laneY, boxes, nodes, width, height: y};
  }

  const f = v => v.toFixed(1);
  function edgePath(a, b, relation, gap) {
    if (relation === "lane") {
      const x1 = a.x + a.w, y1 = a.y + a.h / 2, x2 = b.x, y2 = b.y + b.h / 2;
      const d = Math.max(30, Math.abs(x2 - x1) / 2);
      return `M${f(x1)},${f(y1)} C${f(x1 + d)},${f(y1)} ${f(x2 - d)},${f(y2)} ${f(x2)},${f(y2)}`;
    }
    if (relation === "inner") {
      const x1 = a.x + a.w / 2, y1 = a.y + a.h, x2 = b.x + b.w / 2, y2 = b.y, my = (y1 + y2) / 2;
      return `M${f(x1)},${f(y1)} C${f(x1)},${f(my)} ${f(x2)},${f(my)} ${f(x2)},${f(y2)}`;
    }
    const down = b.y > a.y;
    const x1 = a.x + a.w / 2, y1 = down ? a.y + a.h : a.y;
    const x2 = b.x + b.w / 2, y2 = down ? b.y : b.y + b.h;
    const g = down ? gap - 5 : gap + 5;
    const r = Math.min(8, Math.abs(x2 - x1) / 2, Math.abs(g - y1), Math.abs(y2 - g));
    const sx = x2 > x1 ? 1 : -1, sy = down ? 1 : -1;
    return `M${f(x1)},${f(y1)} V${f(g - sy * r)} Q${f(x1)},${f(g)} ${f(x1 + sx * r)},${f(g)} ` +
      `H${f(x2 - sx * r)} Q${f(x2)},${f(g)} ${f(x2)},${f(g + sy * r)} V${f(y2)}`;
  }
  return {place, edgePath};
})();

// The mesh and the build's group table (planc/plan/layout.py, planc/program/groups.py): which
// ranks a collective of a node joins, seen from any rank.
const Mesh = (mesh, rules) => {
  const axes = Object.keys(mesh.sizes);
  const coords = rank => Object.fromEntries(axes.map(a =>
    [a, Math.floor(rank / mesh.strides[a]) % mesh.sizes[a]]));
  const rankOf = c => axes.reduce((sum, a) => sum + (c[a] || 0) * mesh.strides[a], 0);
  const nodeOf = rank => Math.floor(rank / mesh.devicesPerNode);
  const range = n => Array.from({length: n}, (_, i) => i);

  function part(whole, rank, split) {
    if (split === "intra") return whole.filter(r => nodeOf(r) === nodeOf(rank));
    const byNode = new Map();
    for (const r of whole) {
      if (!byNode.has(nodeOf(r))) byNode.set(nodeOf(r), []);
      byNode.get(nodeOf(r)).push(r);
    }
    const local = byNode.get(nodeOf(rank)).indexOf(rank);
    return [...byNode.values()].filter(m => local < m.length).map(m => m[local]);
  }

  function members(rank, rule) {
    if (rule.split) {
      const whole = members(rank, {...rule, split: null});
      return whole.length ? part(whole, rank, rule.split) : [];
    }
    const c = coords(rank), allowed = rule.coordinates || {};
    if (Object.entries(allowed).some(([a, values]) => !values.includes(c[a]))) return [];
    let out = [rank - rule.axes.reduce((s, a) => s + c[a] * mesh.strides[a], 0)];
    for (const a of rule.axes) {
      const values = allowed[a] || range(mesh.sizes[a]);
      out = out.flatMap(m => values.map(v => m + v * mesh.strides[a]));
    }
    return out.sort((x, y) => x - y);
  }

  // The ranks a transfer node joins on ``rank`` (a rank of the node's stage).
  function groupOf(node, rank) {
    if (node.axis === "pp") {
      const peer = rankOf({...coords(rank), pp: node.peer});
      return [rank, peer].sort((x, y) => x - y);
    }
    const ref = node.level && node.level !== "whole" ? `${node.axis}/${node.level}` : node.axis;
    const rule = rules.find(r => r.ref === ref);
    return rule ? members(rank, rule) : [];
  }

  function placement(ranks) {
    const on = new Set(ranks.map(nodeOf));
    return on.size === 1 ? "intra-node" : on.size === ranks.length ? "inter-node" : "mixed";
  }
  return {coords, rankOf, nodeOf, members, groupOf, placement, world: mesh.world};
};
