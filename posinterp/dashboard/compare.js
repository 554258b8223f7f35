// The posinterp compare page's own script (posinterp/viz/compare.py embeds it).
// Text from data is only ever set with textContent, never innerHTML.
const DATA = JSON.parse(document.getElementById('compare-data').textContent);
const META = DATA.meta;
const NAMES = META.names;
function records(t) { return t.rows.map(r => Object.fromEntries(t.columns.map((c, i) => [c, r[i]]))); }
const HEADS = records(DATA.heads);
const KERNELS = records(DATA.kernels);
const EIG = records(DATA.eig);
const SCORES = records(DATA.scores);  // per-head scalars only: compare.py leaves DATA.vector_metrics out
const FREQ = records(DATA.frequency);  // frequency_share, one row per side, offset and rotary pair
const BY_ID = Object.fromEntries(HEADS.map(r => [r.layer + '-' + r.head, r]));
const KEYS = DATA.heads.columns.filter(c => c !== 'layer' && c !== 'head');
const COLOURS = {a: '#08519c', b: '#e4572e'};
function mix(a, b, t) { return 'rgb(' + a.map((x, i) => Math.round(x + (b[i] - x) * t)).join(',') + ')'; }
function shade(t, signed) {  // magnitudes: light to dark blue; signed changes: blue, white at 0, red
  if (!signed) return mix([247, 251, 255], [8, 48, 107], t);
  return t < 0.5 ? mix([8, 81, 156], [255, 255, 255], 2 * t) : mix([255, 255, 255], [203, 24, 29], 2 * t - 1);
}
let SELECTED = null;
function drawGrid() {
  const k = document.getElementById('colour-key').value;
  const vals = HEADS.map(r => r[k]).filter(v => v !== null);
  // signed changes get a symmetric scale around 0; magnitudes start at 0
  const signed = k.startsWith('delta_');
  let lo = signed ? -Math.max(...vals.map(Math.abs)) : 0, hi = Math.max(...vals.map(Math.abs), 0);
  document.getElementById('bar-lo').textContent = fmt(lo);
  document.getElementById('bar-hi').textContent = fmt(hi);
  document.querySelector('.bar').style.background = signed
    ? 'linear-gradient(to right, rgb(8,81,156), #fff, rgb(203,24,29))' : '';
  const grid = document.getElementById('grid');
  grid.replaceChildren();
  const head = el('tr'); head.appendChild(el('th', {}, 'layer \\ head'));
  for (let h = 0; h < META.n_heads; h++) head.appendChild(el('th', {}, 'H' + h));
  grid.appendChild(head);
  for (let l = 0; l < META.n_layers; l++) {
    const tr = el('tr'); tr.appendChild(el('th', {}, 'L' + l));
    for (let h = 0; h < META.n_heads; h++) {
      const id = l + '-' + h, v = BY_ID[id] ? BY_ID[id][k] : null;
      const t = (v === null || hi === lo) ? 0 : (v - lo) / (hi - lo);
      const td = el('td', {title: 'L' + l + 'H' + h + '  ' + k + ' = ' + fmt(v)}, fmt(v));
      td.style.background = shade(t, signed);
      td.style.color = (signed ? Math.abs(t - 0.5) > 0.3 : t > 0.55) ? '#fff' : '#111';
      if (id === SELECTED) td.classList.add('sel');
      td.onclick = () => openCard(id);
      tr.appendChild(td);
    }
    grid.appendChild(tr);
  }
}
let SORT = {key: 'change', desc: true};
function drawList() {
  const table = document.getElementById('list');
  table.replaceChildren();
  const cols = ['layer', 'head', ...KEYS.filter(k => !k.includes('_null_percentile_se'))];
  const tr = el('tr');
  for (const c of cols) {
    const th = el('th', {title: 'click to sort'}, c + (SORT.key === c ? (SORT.desc ? ' ▼' : ' ▲') : ''));
    th.onclick = () => { SORT = {key: c, desc: SORT.key === c ? !SORT.desc : true}; drawList(); };
    tr.appendChild(th);
  }
  table.appendChild(tr);
  const rows = HEADS.slice();
  rows.sort((a, b) => { const x = a[SORT.key], y = b[SORT.key];
    if (x === null) return 1; if (y === null) return -1; return SORT.desc ? y - x : x - y; });
  for (const r of rows) {
    const row = el('tr');
    for (const c of cols) row.appendChild(el('td', {}, fmt(r[c])));
    row.onclick = () => openCard(r.layer + '-' + r.head);
    table.appendChild(row);
  }
  document.getElementById('count').textContent = HEADS.length + ' heads';
}
function drawFormed() {
  const t = document.getElementById('formed');
  const rows = records(DATA.formed);
  if (!rows.length) { t.replaceWith(el('p', {class: 'facts'}, 'None: no head crossed a threshold.')); return; }
  t.appendChild(el('tr')).append(...['event', 'head', 'criterion', 'threshold', 'A', 'B'].map(c => el('th', {}, c)));
  for (const r of rows) {
    const tr = el('tr');
    tr.append(el('td', {}, r.event), el('td', {}, 'L' + r.layer + 'H' + r.head), el('td', {}, r.criterion),
              el('td', {}, fmt(r.threshold)), el('td', {}, fmt(r.a)), el('td', {}, fmt(r.b)));
    tr.style.cursor = 'pointer';
    tr.onclick = () => openCard(r.layer + '-' + r.head);
    t.appendChild(tr);
  }
}
function drawLayers() {
  const t = document.getElementById('layers');
  t.appendChild(el('tr')).append(...['layer', 'site', 'A', 'B', 'B − A'].map(c => el('th', {}, c)));
  for (const r of records(DATA.layers)) {
    const tr = el('tr');
    tr.append(el('td', {}, r.layer === -1 ? 'embedding (-1)' : String(r.layer)),
              el('td', {}, r.hook.split('.').pop().replace('hook_', '')),
              el('td', {}, fmt(r.a)), el('td', {}, fmt(r.b)), el('td', {}, fmt(r.delta)));
    t.appendChild(tr);
  }
}
function linePlot(title, metric, l, h, ylab) {
  const W = 360, H = 180, L = 46, R = 10, T = 18, B = 30;
  const s = svg('svg', {width: W, height: H});
  s.appendChild(svg('text', {x: L, y: 12}, title));
  const rows = KERNELS.filter(r => r.metric === metric && r.layer === l && r.head === h).sort((a, b) => a.offset - b.offset);
  const pts = {a: rows.filter(r => r.a !== null), b: rows.filter(r => r.b !== null)};
  if (!pts.a.length && !pts.b.length) return s;
  const xs = rows.map(r => r.offset), ys = rows.flatMap(r => [r.a, r.b]).filter(v => v !== null);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys); if (y1 === y0) { y1 += 1; y0 -= 1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const w of ['a', 'b'])
    s.appendChild(svg('polyline', {points: pts[w].map(r => X(r.offset) + ',' + Y(r[w])).join(' '),
                                   fill: 'none', stroke: COLOURS[w], 'stroke-width': 1.5}));
  s.appendChild(svg('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: '#666'}));
  s.appendChild(svg('line', {x1: L, x2: L, y1: T, y2: H - B, stroke: '#666'}));
  const step = Math.max(1, Math.ceil((x1 - x0) / 8));
  for (let x = x1; x >= x0; x -= step)
    s.appendChild(svg('text', {x: X(x), y: H - B + 13, 'text-anchor': 'middle'}, String(x)));
  for (const y of [y0, (y0 + y1) / 2, y1])
    s.appendChild(svg('text', {x: L - 4, y: Y(y) + 3, 'text-anchor': 'end'}, fmt(y)));
  s.appendChild(svg('text', {x: (L + W - R) / 2, y: H - 3, 'text-anchor': 'middle'}, 'key offset Δ = j − i'));
  s.appendChild(svg('text', {x: 10, y: (T + H - B) / 2, transform: 'rotate(-90 10 ' + (T + H - B) / 2 + ')',
                             'text-anchor': 'middle'}, ylab));
  return s;
}
function eigenPlot(l, h, offset) {
  const S = 200, C = S / 2;
  const s = svg('svg', {width: S, height: S + 16});
  const rows = EIG.filter(r => r.layer === l && r.head === h && r.offset === offset);
  const sides = ['a', 'b'].filter(w => rows.some(r => r.which === w));
  const rmax = Math.max(...rows.map(r => Math.hypot(r.re, r.im)), 1e-12) * 1.1;
  const P = v => C + v / rmax * (C - 4);
  s.appendChild(svg('line', {x1: 0, x2: S, y1: C, y2: C, stroke: '#999'}));
  s.appendChild(svg('line', {x1: C, x2: C, y1: 0, y2: S, stroke: '#999'}));
  for (const r of rows)
    s.appendChild(svg('circle', {cx: P(r.re), cy: P(-r.im), r: 3, fill: COLOURS[r.which], opacity: 0.8}));
  const only = sides.length === 1 ? ' (' + NAMES[sides[0] === 'a' ? 0 : 1] + ' only, not compared)' : '';
  s.appendChild(svg('text', {x: 2, y: S + 12}, (offset === null ? '' : 'Δ = ' + offset + ': ') + 'QK eigenvalues' + only));
  s.appendChild(svg('text', {x: S - 2, y: 10, 'text-anchor': 'end'}, '|λ| max ' + fmt(rmax / 1.1)));
  return s;
}
function spectrumOffsets(l, h) {  // Δ = 0 first, then -1; null: a non-rotary pair's one form
  const offs = [...new Set(EIG.filter(r => r.layer === l && r.head === h).map(r => r.offset))];
  return offs.sort((x, y) => (x === null) - (y === null) || y - x);
}
function frequencyTable(l, h) {
  // One row per offset and rotary pair: pairs are never merged into one per-head score.
  const cells = {};
  for (const r of FREQ.filter(r => r.layer === l && r.head === h)) {
    const k = r.offset + '|' + r.rank;
    (cells[k] = cells[k] || {offset: r.offset, rank: r.rank})[r.which] = r.value;
  }
  const rows = Object.values(cells).sort((x, y) => y.offset - x.offset ||
    (x.rank === null) - (y.rank === null) || x.rank - y.rank);
  if (!rows.length) return null;
  const t = el('table', {class: 'scores frequency'});
  t.appendChild(el('tr')).append(...['Δ', 'rotary pair', 'A: ' + NAMES[0], 'B: ' + NAMES[1], 'B − A'].map(c => el('th', {}, c)));
  for (const r of rows) {
    const tr = el('tr', {'data-offset': r.offset, 'data-pair': r.rank === null ? 'unrotated' : r.rank});
    tr.append(el('td', {}, String(r.offset)), el('td', {}, r.rank === null ? 'unrotated dims' : 'pair ' + r.rank),
              side(r, 'a'), side(r, 'b'), el('td', {}, fmt(defined(r) ? r.b - r.a : null)));
    t.appendChild(tr);
  }
  return t;
}
function defined(v) { return v.a !== undefined && v.b !== undefined && v.a !== null && v.b !== null; }
function side(v, w) {  // a value, or a dash saying that this side does not define it
  if (v[w] !== undefined) return el('td', {}, fmt(v[w]));
  return el('td', {title: 'not defined for ' + NAMES[w === 'a' ? 0 : 1] + ': not compared'}, '—');
}
function scoreKey(r) {
  let k = r.metric;
  if (r.ablation) k += '[' + r.ablation + ']';
  if (r.offset !== null) k += '@Δ=' + r.offset;
  return k;
}
function openCard(id) {
  SELECTED = id;
  const [l, h] = id.split('-').map(Number);
  const card = document.getElementById('card');
  card.replaceChildren();
  card.appendChild(el('h2', {}, 'Layer ' + l + ', head ' + h));
  card.appendChild(el('p', {class: 'facts'}, 'change ' + fmt(BY_ID[id].change) + ' (kernel ' +
    fmt(BY_ID[id].kernel_attention_change) + ', spectrum ' + fmt(BY_ID[id].spectrum_change) + ')'));
  const t = el('table', {class: 'scores'});
  t.appendChild(el('tr')).append(el('th', {}, 'score'), el('th', {}, 'A: ' + NAMES[0]),
                                 el('th', {}, 'B: ' + NAMES[1]), el('th', {}, 'B − A'));
  const vals = {};
  for (const r of SCORES.filter(r => r.layer === l && r.head === h)) {
    const k = scoreKey(r);
    if (k.includes('_null_percentile_se')) continue;
    (vals[k] = vals[k] || {})[r.which] = r.value;
  }
  for (const [k, v] of Object.entries(vals)) {
    const tr = el('tr');
    tr.append(el('td', {}, k), side(v, 'a'), side(v, 'b'), el('td', {}, fmt(defined(v) ? v.b - v.a : null)));
    t.appendChild(tr);
  }
  card.appendChild(t);
  card.appendChild(el('h3', {}, 'Positional kernel (blue A, red B)'));
  const plots = el('div', {class: 'plots'});
  plots.appendChild(linePlot('mean attention weight A[i, i+Δ]', 'kernel_attention', l, h, 'attention'));
  plots.appendChild(linePlot('mean pre-softmax score', 'kernel_score', l, h, 'score'));
  card.appendChild(plots);
  card.appendChild(el('h3', {}, 'QK eigenvalues of W_K^T W_Q (blue A, red B)'));
  const eig = el('div', {class: 'plots'});
  for (const o of spectrumOffsets(l, h)) eig.appendChild(eigenPlot(l, h, o));
  card.appendChild(eig);
  const freq = frequencyTable(l, h);
  if (freq) {
    card.appendChild(el('h3', {}, 'Share of QK energy per rotary pair (frequency_share)'));
    card.appendChild(freq);
    card.appendChild(el('p', {class: 'facts'}, 'One row per offset and rotary pair (pair 0 turns fastest); the shares of one side and offset sum to 1.'));
  }
  drawGrid();
}
function init() {
  const s = document.getElementById('colour-key');
  for (const k of KEYS) s.appendChild(el('option', {value: k}, k));
  s.value = 'change';
  s.addEventListener('input', drawGrid);
  drawList(); drawFormed(); drawLayers();
  if (HEADS.length) openCard(HEADS[0].layer + '-' + HEADS[0].head);  // the largest change
  else drawGrid();
}
init();
