// The posinterp inspect page's own script (posinterp/viz/inspect.py embeds it).
// Text from data is only ever set with textContent, never innerHTML.
const RAW = JSON.parse(document.getElementById('inspect-data').textContent);
const META = RAW.meta;
const ROWS = decodeTable(RAW.table);  // posinterp/dashboard/columns.py's encoding
const VECTOR = new Set(RAW.vector_metrics);  // the inspection schema's list (analysis/inspect.py)
// The inspected heads: a selection (--layers/--heads), else every one (older files: no list).
const range = n => Array.from({length: n}, (_, i) => i);
const LAYERS = META.layers || range(META.n_layers);
const HEAD_IDS = META.heads || range(META.n_heads);
function key(r) {
  let k = r.metric;
  if (r.ablation) k += '[' + r.ablation + ']';
  if (r.offset !== null) k += '@Δ=' + r.offset;
  return k;
}
const HEADS = {};   // "l-h" -> {score key: row}
const SCORE_KEYS = [];
for (const r of ROWS) {
  if (r.head === null || VECTOR.has(r.metric)) continue;
  const id = r.layer + '-' + r.head, k = key(r);
  (HEADS[id] = HEADS[id] || {})[k] = r;
  if (!SCORE_KEYS.includes(k)) SCORE_KEYS.push(k);
}
// A score column's value as text: percentiles from a finite null are good to about a
// point (their _se column), so they print as whole points.
function fmtKey(k, v) {
  if (v !== null && v !== undefined && /_null_percentile(_se)?(@|$)/.test(k))
    return k.includes('_se') ? v.toFixed(1) : v.toFixed(0);
  return fmt(v);
}
function val(id, k) { const r = (HEADS[id] || {})[k]; return r ? r.value : null; }
function shade(t) {  // 0..1 -> light to dark blue, as the colour bar
  const a = [247, 251, 255], b = [8, 48, 107];
  return 'rgb(' + a.map((x, i) => Math.round(x + (b[i] - x) * t)).join(',') + ')';
}
function passes(id) {
  const k = document.getElementById('filter-key').value;
  const lim = parseFloat(document.getElementById('filter-min').value);
  if (Number.isNaN(lim)) return true;
  const v = val(id, k);
  return v !== null && v >= lim;
}
let SELECTED = null;
function drawGrid() {
  const k = document.getElementById('colour-key').value;
  const scale = RAW.colour_scales[k] || {lo: 0, hi: 0, absolute: false};
  const lo = scale.lo, hi = scale.hi;
  document.getElementById('bar-lo').textContent = fmtKey(k, lo);
  document.getElementById('bar-hi').textContent = fmtKey(k, hi);
  document.getElementById('bar-kind').textContent = scale.absolute
    ? '(absolute scale: the score\'s whole range)'
    : '(relative scale: lowest to highest head on this page)';
  const grid = document.getElementById('grid');
  grid.replaceChildren();
  const head = el('tr'); head.appendChild(el('th', {}, 'layer \\ head'));
  for (const h of HEAD_IDS) head.appendChild(el('th', {}, 'H' + h));
  grid.appendChild(head);
  for (const l of LAYERS) {
    const tr = el('tr'); tr.appendChild(el('th', {}, 'L' + l));
    for (const h of HEAD_IDS) {
      const id = l + '-' + h, v = val(id, k);
      const t = (v === null || hi === lo) ? 0 : Math.min(1, Math.max(0, (v - lo) / (hi - lo)));
      const td = el('td', {title: 'L' + l + 'H' + h + '  ' + k + ' = ' + fmtKey(k, v)}, fmtKey(k, v));
      td.style.background = shade(t);
      td.style.color = t > 0.55 ? '#fff' : '#111';
      if (!passes(id)) td.classList.add('off');
      if (id === SELECTED) td.classList.add('sel');
      td.onclick = () => openCard(id);
      tr.appendChild(td);
    }
    grid.appendChild(tr);
  }
  drawList();
}
let SORT = {key: null, desc: true};
function drawList() {
  const shown = SCORE_KEYS.filter(k => document.getElementById('cols-all').checked || !k.includes('_null_percentile') || k.startsWith('rotational_mass'));
  const table = document.getElementById('list');
  table.replaceChildren();
  const tr = el('tr');
  for (const c of ['layer', 'head', ...shown]) {
    const th = el('th', {title: 'click to sort'}, c + (SORT.key === c ? (SORT.desc ? ' ▼' : ' ▲') : ''));
    th.onclick = () => { SORT = {key: c, desc: SORT.key === c ? !SORT.desc : true}; drawList(); };
    tr.appendChild(th);
  }
  table.appendChild(tr);
  let ids = Object.keys(HEADS).filter(passes);
  if (SORT.key) {
    const g = id => SORT.key === 'layer' ? +id.split('-')[0] : SORT.key === 'head' ? +id.split('-')[1] : val(id, SORT.key);
    ids.sort((a, b) => { const x = g(a), y = g(b);
      if (x === null) return 1; if (y === null) return -1; return SORT.desc ? y - x : x - y; });
  }
  for (const id of ids) {
    const row = el('tr');
    const [l, h] = id.split('-');
    row.appendChild(el('td', {}, l)); row.appendChild(el('td', {}, h));
    for (const k of shown) row.appendChild(el('td', {}, fmtKey(k, val(id, k))));
    row.onclick = () => { openCard(id); document.getElementById('card').scrollIntoView({block: 'nearest'}); };
    table.appendChild(row);
  }
  document.getElementById('count').textContent = ids.length + ' of ' + Object.keys(HEADS).length + ' heads shown';
}
function seriesOf(metric, l, h) {
  return ROWS.filter(r => r.metric === metric && r.layer === l && r.head === h)
             .sort((a, b) => a.offset - b.offset);
}
// Width of a text at the page's 10 px SVG font, a bound for digits, signs and letters.
const CHAR_PX = 6.5;
const textPx = t => CHAR_PX * String(t).length;
function linePlot(title, rows, ylab, denseLags = null) {
  const W = 360, H = 180, R = 10, T = 18, B = 30;
  const pts = rows.filter(r => r.value !== null);
  // binned long-range offsets (denseLags: META.kernel_dense_lags): the axis is
  // log(1 + |Δ|), so the dense short lags and the bins out to Δ = -(n - 1) stay readable
  const logx = denseLags != null;
  const tx = x => logx ? -Math.log10(1 + Math.abs(x)) : x;
  const xs = pts.map(r => tx(r.offset));
  const ys = pts.flatMap(r => [r.value, r.ci_low, r.ci_high]).filter(v => v !== null);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys); if (y1 === y0) { y1 += 1; y0 -= 1; }
  const yticks = [y0, (y0 + y1) / 2, y1];
  // the left margin holds the longest tick label whole (a minus sign included) and the axis title
  const L = Math.max(46, 24 + Math.max(...yticks.map(y => textPx(fmt(y)))));
  const s = svg('svg', {width: W, height: H});
  s.appendChild(svg('text', {x: L, y: 12}, title));
  if (!pts.length) return s;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const band = pts.filter(r => r.ci_low !== null && r.ci_high !== null);
  if (band.length > 1) {
    const up = band.map(r => X(tx(r.offset)) + ',' + Y(r.ci_high));
    const dn = band.slice().reverse().map(r => X(tx(r.offset)) + ',' + Y(r.ci_low));
    s.appendChild(svg('polygon', {points: up.concat(dn).join(' '), fill: '#9ecae1', opacity: 0.6}));
  }
  s.appendChild(svg('polyline', {points: pts.map(r => X(tx(r.offset)) + ',' + Y(r.value)).join(' '),
                                 fill: 'none', stroke: '#08519c', 'stroke-width': 1.5}));
  for (const r of pts) s.appendChild(svg('circle', {cx: X(tx(r.offset)), cy: Y(r.value), r: 1.8, fill: '#08519c'}));
  s.appendChild(svg('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: '#666'}));
  s.appendChild(svg('line', {x1: L, x2: L, y1: T, y2: H - B, stroke: '#666'}));
  // integer offsets, spaced so that the widest label fits between two ticks; on the log
  // axis 0, -1, -10, -100, ...
  const ticks = [];
  if (logx) {
    for (let d = 0; tx(d) >= x0 - 1e-9; d = d === 0 ? 1 : d * 10) ticks.push(-d);
  } else {
    const widest = Math.max(textPx(String(x0)), textPx(String(x1)));
    const step = Math.max(1, Math.ceil((x1 - x0) / 8), Math.ceil((widest + 6) * (x1 - x0) / (W - L - R)));
    for (let x = x1; x >= x0; x -= step) ticks.push(x);
  }
  for (const x of ticks) {
    s.appendChild(svg('line', {x1: X(tx(x)), x2: X(tx(x)), y1: H - B, y2: H - B + 3, stroke: '#666'}));
    s.appendChild(svg('text', {x: X(tx(x)), y: H - B + 13, 'text-anchor': 'middle', class: 'xtick'}, String(x)));
  }
  for (const y of yticks)
    s.appendChild(svg('text', {x: L - 4, y: Y(y) + 3, 'text-anchor': 'end', class: 'ytick'}, fmt(y)));
  s.appendChild(svg('text', {x: (L + W - R) / 2, y: H - 3, 'text-anchor': 'middle'},
                             logx ? 'key offset Δ = j − i (log scale; bins past Δ = −' + (denseLags - 1) + ')'
                                  : 'key offset Δ = j − i'));
  s.appendChild(svg('text', {x: 10, y: (T + H - B) / 2, transform: 'rotate(-90 10 ' + (T + H - B) / 2 + ')',
                             'text-anchor': 'middle'}, ylab));
  return s;
}
function eigenPlot(l, h, offset) {
  const S = 200, C = S / 2;
  const s = svg('svg', {width: S, height: S + 16});
  const match = r => r.layer === l && r.head === h && r.offset === offset;
  const re = ROWS.filter(r => r.metric === 'eigenvalue_real' && match(r)).sort((a, b) => a.rank - b.rank);
  const im = ROWS.filter(r => r.metric === 'eigenvalue_imag' && match(r)).sort((a, b) => a.rank - b.rank);
  const id = l + '-' + h;
  const blo = val(id, 'null_band_low'), bhi = val(id, 'null_band_high');
  const rmax = Math.max(...re.map((r, i) => Math.hypot(r.value, im[i].value)), bhi || 0, 1e-12) * 1.1;
  const P = v => C + v / rmax * (C - 4);
  if (blo !== null && bhi !== null) {
    const r1 = bhi / rmax * (C - 4), r0 = blo / rmax * (C - 4);
    s.appendChild(svg('path', {d: `M ${C - r1} ${C} a ${r1} ${r1} 0 1 0 ${2 * r1} 0 a ${r1} ${r1} 0 1 0 ${-2 * r1} 0 ` +
                                  `M ${C - r0} ${C} a ${r0} ${r0} 0 1 1 ${2 * r0} 0 a ${r0} ${r0} 0 1 1 ${-2 * r0} 0`,
                               fill: '#ddd', 'fill-rule': 'evenodd'}));
  }
  s.appendChild(svg('line', {x1: 0, x2: S, y1: C, y2: C, stroke: '#999'}));
  s.appendChild(svg('line', {x1: C, x2: C, y1: 0, y2: S, stroke: '#999'}));
  re.forEach((r, i) => s.appendChild(svg('circle', {cx: P(r.value), cy: P(-im[i].value), r: 3,
                                                    fill: Math.abs(im[i].value) > 0 ? '#e4572e' : '#08519c'})));
  const k = offset === null ? '' : '@Δ=' + offset;
  const rm = val(id, 'rotational_mass' + k), pct = val(id, 'rotational_mass_null_percentile' + k);
  s.appendChild(svg('text', {x: 2, y: S + 12}, (offset === null ? '' : 'Δ = ' + offset + ': ') +
                             'rot. mass ' + fmt(rm) + ' (null pct ' + fmtKey('_null_percentile', pct) + ')'));
  s.appendChild(svg('text', {x: S - 2, y: 10, 'text-anchor': 'end'}, '|λ| max ' + fmt(rmax / 1.1)));
  return s;
}
function frequencyPlot(l, h, offset) {
  // Share of the head's QK energy per rotary pair (rope_frequency_profile, metric qk), one
  // bar per pair, fastest first, the unrotated dims of a partial-rotary head last.
  const theta = {};
  for (const r of ROWS) if (r.metric === 'rotary_frequency' && r.layer === l) theta[r.rank] = r.value;
  const bars = ROWS.filter(r => r.metric === 'frequency_share' && r.layer === l && r.head === h && r.offset === offset)
                   .sort((a, b) => (a.rank === null) - (b.rank === null) || a.rank - b.rank);
  const period = p => (p === null || !theta[p]) ? null : 2 * Math.PI / theta[p];
  const label = r => r.rank === null ? 'unrot.' : fmtPeriod(period(r.rank));
  const W = 360, H = 170, L = 40, T = 18, B = 34;
  // room on the right for half the last bar's label (the unrotated dims' is always shown)
  const R = bars.length ? Math.max(8, textPx(label(bars[bars.length - 1])) / 2 + 2) : 8;
  const s = svg('svg', {width: W, height: H, class: 'freq-profile', 'data-offset': offset});
  s.appendChild(svg('text', {x: L, y: 12}, 'share of QK energy per rotary pair, Δ = ' + offset));
  if (!bars.length) return s;
  const ymax = Math.max(...bars.map(r => r.value || 0), 1e-12);
  const bw = (W - L - R) / bars.length;
  // label every k-th bar, k such that the widest label fits between two labelled bars
  const every = Math.max(1, Math.ceil((Math.max(...bars.map(r => textPx(label(r)))) + 6) / bw));
  const centre = i => L + i * bw + bw / 2;
  const last = bars.length - 1;
  const labelled = new Set();
  bars.forEach((r, i) => { if (i % every === 0 && r.rank !== null) labelled.add(i); });
  if (bars[last].rank === null) {  // the unrotated dims' bar is always named: make room for it
    for (const i of [...labelled]) if (centre(last) - centre(i) < (textPx(label(bars[i])) + textPx('unrot.')) / 2 + 6) labelled.delete(i);
    labelled.add(last);
  }
  bars.forEach((r, i) => {
    const v = r.value || 0, x = L + i * bw, y = T + (1 - v / ymax) * (H - T - B);
    const per = period(r.rank);
    const rect = svg('rect', {x: x + 0.1 * bw, y: y, width: 0.8 * bw, height: H - B - y,
                              fill: r.rank === null ? '#999' : '#08519c',
                              'data-pair': r.rank === null ? 'unrotated' : r.rank, 'data-share': r.value});
    rect.appendChild(svg('title', {}, (r.rank === null ? 'unrotated dims' : 'pair ' + r.rank + ', period ' + fmt(per) + ' tokens') + ': share ' + fmt(r.value)));
    s.appendChild(rect);
    if (labelled.has(i))
      s.appendChild(svg('text', {x: centre(i), y: H - B + 12, 'text-anchor': 'middle', class: 'xtick'}, label(r)));
  });
  s.appendChild(svg('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: '#666'}));
  for (const y of [0, ymax / 2, ymax])
    s.appendChild(svg('text', {x: L - 4, y: T + (1 - y / ymax) * (H - T - B) + 3, 'text-anchor': 'end'}, fmt(y)));
  s.appendChild(svg('text', {x: (L + W - R) / 2, y: H - 3, 'text-anchor': 'middle'}, 'period 2π/θ (tokens), fastest pair first'));
  return s;
}
// A period in tokens, short: 6.3, 57, 1234, 4.4e+5.
function fmtPeriod(p) {
  if (p === null || p === undefined || !Number.isFinite(p)) return '?';
  if (p < 100) return p.toPrecision(2).replace(/\.0$/, '');
  if (p < 1e4) return String(Math.round(p));
  return p.toExponential(1);
}
// One head's pattern from the page's pattern data (viz/inspect.py encode_pattern): the
// lower triangle, row by row, as little-endian uint16 levels of 1/65535, base64.
function decodePattern(b64, m) {
  const bin = atob(b64), out = [];
  let k = 0;
  for (let i = 0; i < m; i++) {
    const row = new Array(m).fill(0);
    for (let j = 0; j <= i; j++, k += 2) row[j] = (bin.charCodeAt(k) | (bin.charCodeAt(k + 1) << 8)) / 65535;
    out.push(row);
  }
  return out;
}
const PATTERNS = JSON.parse(document.getElementById('pattern-data').textContent);
let VIEW = 0;  // the sequence picker's choice
let PATTERN_ID = 0;
function patternSection(card, id) {
  const views = PATTERNS.views.filter(v => v.heads[id]);
  if (!views.length) return;
  if (!PATTERNS.views[VIEW] || !PATTERNS.views[VIEW].heads[id]) VIEW = PATTERNS.views.indexOf(views[0]);
  const v = PATTERNS.views[VIEW];
  const h3 = el('h3', {}, 'Attention pattern on ');
  const pick = el('select', {id: 'seq-pick', title: 'which sequence the pattern shows'});
  PATTERNS.views.forEach((w, i) => { if (w.heads[id]) {
    const o = el('option', {value: i}, w.label + ' (' + w.n_tokens + ' tokens)');
    if (i === VIEW) o.selected = true;
    pick.appendChild(o); } });
  pick.onchange = () => { VIEW = +pick.value; openCard(id); };
  h3.appendChild(pick);
  if (v.block > 1) h3.appendChild(document.createTextNode(' (all ' + v.n_tokens + ' tokens, pooled: 1 cell = ' + v.block + ' × ' + v.block + ' tokens)'));
  card.appendChild(h3);
  const holder = el('div', {id: 'pattern-view-' + (++PATTERN_ID)});
  card.appendChild(holder);
  if (typeof CircuitsVis !== 'undefined')
    CircuitsVis.render(holder.id, CircuitsVis[PATTERN_COMPONENT], {tokens: v.tokens, attention: decodePattern(v.heads[id], v.tokens.length)});
}
function openCard(id) {
  SELECTED = id;
  const [l, h] = id.split('-').map(Number);
  const card = document.getElementById('card');
  card.replaceChildren();
  card.appendChild(el('h2', {}, 'Layer ' + l + ', head ' + h));
  const t = el('table', {class: 'scores'});
  t.appendChild(el('tr')).append(el('th', {}, 'score'), el('th', {}, 'value'), el('th', {}, '95% interval over sequences'));
  for (const k of ['previous_token_score', 'self_score', 'first_token_score', 'induction_score',
                   'induction_score_input', 'positional_score']) {
    const r = HEADS[id][k];
    if (!r) continue;
    const tr = el('tr');
    tr.append(el('td', {}, k), el('td', {}, fmt(r.value)),
              el('td', {}, r.ci_low === null ? '' : fmt(r.ci_low) + ' … ' + fmt(r.ci_high)));
    t.appendChild(tr);
  }
  card.appendChild(t);
  card.appendChild(el('h3', {}, 'Positional kernel'));
  const plots = el('div', {class: 'plots'});
  plots.appendChild(linePlot('mean attention weight A[i, i+Δ]', seriesOf('kernel_attention', l, h), 'attention',
                             META.kernel_dense_lags));
  plots.appendChild(linePlot('mean pre-softmax score', seriesOf('kernel_score', l, h), 'score',
                             META.kernel_dense_lags));
  card.appendChild(plots);
  card.appendChild(el('p', {class: 'facts'}, 'Means over each sequence\'s queries, then over sequences; the band is a 95% Student-t interval over sequences.'));
  card.appendChild(el('h3', {}, 'QK eigenvalues (W_K^T W_Q)'));
  const eig = el('div', {class: 'plots'});
  const offs = META.rotary ? [0, -1] : [null];
  for (const o of offs) eig.appendChild(eigenPlot(l, h, o));
  card.appendChild(eig);
  card.appendChild(el('p', {class: 'facts'}, 'Red: complex eigenvalues (rotational channel), blue: real. Grey band: 5%–95% of |λ| of random heads with this head\'s weight scale. The band comes from ' + META.n_null_band + ' random heads; the percentile places the rotational mass among ' + META.n_null + ' random heads of the same shape.'));
  card.appendChild(el('h3', {}, 'QK energy by rotary frequency'));
  if (META.frequency_note) card.appendChild(el('p', {class: 'facts'}, META.frequency_note));
  else {
    const fq = el('div', {class: 'plots'});
    for (const o of [0, -1]) fq.appendChild(frequencyPlot(l, h, o));
    card.appendChild(fq);
    card.appendChild(el('p', {class: 'facts'}, 'Share of ‖M_p(Δ)‖² per rotary pair p (M_p(Δ) = Q_p R_p(−Δθ_p) K_p^T; shares sum to 1; grey: dims RoPE does not rotate). positional_score: 1 when the logits ignore which token is at a key (positional), 0 when they follow it (symbolic); docs/frequencies.md.'));
  }
  const abl = Object.keys(HEADS[id]).filter(k => k.startsWith('loss_change'));
  if (abl.length) {
    card.appendChild(el('h3', {}, 'Loss change when removed (clean loss ' + fmt(META.clean_loss) + ' nats)'));
    if (META.clean_loss !== null && META.clean_loss >= META.uniform_guess_loss)
      card.appendChild(el('p', {class: 'note'}, 'The clean loss is at or above log(d_vocab) = ' + fmt(META.uniform_guess_loss) +
        ' nats, a uniform guess: the model cannot predict this input, so these changes are changes to its guesses on noise (see the note at the top).'));
    const at = el('table');
    at.appendChild(el('tr')).append(el('th', {}, 'removed'), el('th', {}, 'Δ loss (nats/token)'), el('th', {}, 'how'));
    for (const k of abl) {
      // loss_change_attribution: a first-order estimate (attribution patching), never a measured loss
      const how = HEADS[id][k].metric === 'loss_change_attribution' ? 'approximate (attribution patching)' : 'exact';
      const tr = el('tr'); tr.append(el('td', {}, HEADS[id][k].ablation), el('td', {}, fmt(HEADS[id][k].value)), el('td', {}, how)); at.appendChild(tr);
    }
    card.appendChild(at);
    if (abl.some(k => k.includes('remove_band_')))
      card.appendChild(el('p', {class: 'facts'}, 'remove_band_pA-B: the head\'s query zeroed in rotary pairs A to B, its fastest and its slowest quarter of pairs (pair 0 turns fastest); those pairs then add exactly 0 to every score.'));
  }
  patternSection(card, id);
  if (typeof explainCard === 'function') explainCard(card, l, h);  // explain.js
  drawGrid();
}
function init() {
  for (const sel of ['colour-key', 'filter-key']) {
    const s = document.getElementById(sel);
    for (const k of SCORE_KEYS) s.appendChild(el('option', {value: k}, k));
  }
  document.getElementById('colour-key').value = 'previous_token_score';
  document.getElementById('filter-key').value = 'previous_token_score';
  for (const id of ['colour-key', 'filter-key', 'filter-min', 'cols-all'])
    document.getElementById(id).addEventListener('input', drawGrid);
  drawGrid();
  let best = null;
  for (const id of Object.keys(HEADS)) if (best === null || val(id, 'previous_token_score') > val(best, 'previous_token_score')) best = id;
  openCard(best);
}
init();
