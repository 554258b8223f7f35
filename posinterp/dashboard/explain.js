// ---- Explain one score (posinterp/viz/explain.py embeds this before the page's script) ----
// Each head card gets a clickable pattern; a click shows the parts of that (query, key)
// score, precomputed in Python (posinterp.analysis.explain). Numbers are looked up,
// never recomputed here. Text from data is only ever set with textContent.
const EXPLAIN = (() => {
  const e = document.getElementById('explain-data');
  return e ? JSON.parse(e.textContent) : null;
})();
const EXPLAIN_LABELS = {
  positive_real: 'positive-real channel', negative_real: 'negative-real channel',
  complex: 'complex (rotational) channel', null: 'null remainder (no eigenvalue)',
  q_dot_b_K: 'query weights · b_K', b_Q_dot_k: 'b_Q · key weights', b_Q_dot_b_K: 'b_Q · b_K',
  alibi: 'ALiBi m_h (j − i)', unrotated: 'unrotated dims',
};
function explainNode(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [a, v] of Object.entries(attrs || {})) e.setAttribute(a, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function explainSvg(tag, attrs) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [a, v] of Object.entries(attrs || {})) e.setAttribute(a, v);
  return e;
}
function explainFmt(v) {
  if (v === null || v === undefined) return '—';
  const a = Math.abs(v);
  return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(4) : v.toFixed(5);
}
function explainCell(i, j) { return i * (i + 1) / 2 + j; }
function explainLabel(p) {
  if (p.part === 'pair') {
    const period = p.frequency > 0 ? (2 * Math.PI / p.frequency).toPrecision(4) : '∞';
    return 'pair ' + p.pair + ' (θ = ' + p.frequency.toPrecision(4) + ' rad/token, period ' + period + ')';
  }
  return EXPLAIN_LABELS[p.part] || p.part;
}
function explainTable(data, c, groups, id, title) {
  const t = explainNode('table', {id: id, class: 'scores'});
  const cap = explainNode('caption', {}, title); cap.style.textAlign = 'left';
  t.appendChild(cap);
  t.appendChild(explainNode('tr')).append(explainNode('th', {}, 'part'), explainNode('th', {}, 'logits'),
                                           explainNode('th', {}, 'share of Σ|parts|'));
  const idx = groups.flatMap(g => EXPLAIN.parts.map((p, k) => k).filter(k => EXPLAIN.parts[k].group === g));
  const absSum = idx.reduce((s, k) => s + Math.abs(data.parts[k][c] || 0), 0) || 1;
  let sum = 0;
  for (const k of idx) {
    const p = EXPLAIN.parts[k], v = data.parts[k][c];
    sum += v || 0;
    const tr = explainNode('tr', {'data-part': p.part + (p.pair === null ? '' : ':' + p.pair)});
    const bar = explainSvg('svg', {width: 100, height: 10});
    bar.appendChild(explainSvg('rect', {x: 0, y: 1, height: 8, width: 100 * Math.abs(v || 0) / absSum,
                                        fill: (v || 0) >= 0 ? '#e4572e' : '#3b75af'}));
    const share = explainNode('td'); share.appendChild(bar);
    tr.append(explainNode('td', {}, explainLabel(p)), explainNode('td', {class: 'explain-value'}, explainFmt(v)), share);
    t.appendChild(tr);
  }
  const srow = explainNode('tr', {'data-part': 'sum'});
  srow.append(explainNode('th', {}, 'sum of parts'), explainNode('td', {class: 'explain-value'}, explainFmt(sum)),
              explainNode('td', {}, 'red: raises the score, blue: lowers it'));
  t.appendChild(srow);
  return t;
}
function explainShow(out, data, i, j) {
  out.replaceChildren();
  const c = explainCell(i, j), tok = EXPLAIN.tokens;
  out.appendChild(explainNode('p', {id: 'explain-cell', 'data-query': i, 'data-key': j},
    'query ' + i + ' ' + JSON.stringify(tok[i]) + ' → key ' + j + ' ' + JSON.stringify(tok[j]) +
    ' (offset Δ = ' + (j - i) + ')'));
  const sums = explainNode('table', {id: 'explain-summary', class: 'scores'});
  for (const [k, label] of [['score_total', 'score (sum of parts)'], ['model_score', "model's own pre-softmax score"],
                            ['pattern', 'attention weight']]) {
    const tr = explainNode('tr', {'data-part': k});
    tr.append(explainNode('td', {}, label), explainNode('td', {class: 'explain-value'},
      data[k][c] === null ? (k === 'model_score' ? 'no score hook on this model' : '—') : explainFmt(data[k][c])));
    sums.appendChild(tr);
  }
  out.appendChild(sums);
  const tables = explainNode('div', {class: 'plots'});
  tables.appendChild(explainTable(data, c, ['channel', 'bias'], 'explain-channels', 'By spectral channel of the QK circuit'));
  if (EXPLAIN.parts.some(p => p.group === 'rotary_pair'))
    tables.appendChild(explainTable(data, c, ['rotary_pair', 'bias'], 'explain-pairs', 'By rotary frequency pair'));
  out.appendChild(tables);
}
function explainCard(card, l, h) {
  if (!EXPLAIN) return;
  const sec = explainNode('div', {id: 'explain'});
  sec.appendChild(explainNode('h3', {}, 'Explain one score'));
  sec.appendChild(explainNode('p', {class: 'facts'}, 'Click a (query, key) cell of the pattern: its pre-softmax score split into parts. ' + EXPLAIN.bound));
  sec.appendChild(explainNode('p', {class: 'facts'}, EXPLAIN.formula));
  card.appendChild(sec);
  const data = EXPLAIN.heads[l + '-' + h];
  if (!data) { sec.appendChild(explainNode('p', {class: 'note'}, 'No decomposition for this head.')); return; }
  const n = EXPLAIN.n, size = Math.max(4, Math.min(16, Math.floor(360 / n))), pad = 4;
  const s = explainSvg('svg', {id: 'explain-pattern', width: n * size + 2 * pad, height: n * size + 2 * pad});
  const out = explainNode('div', {id: 'explain-parts'});
  let selected = null;
  const pick = (rect, i, j) => {
    if (selected) selected.setAttribute('stroke', 'none');
    rect.setAttribute('stroke', '#e4572e'); rect.setAttribute('stroke-width', 2);
    selected = rect;
    explainShow(out, data, i, j);
  };
  let first = null;
  for (let i = 0; i < n; i++) for (let j = 0; j <= i; j++) {
    const w = data.pattern[explainCell(i, j)];
    const r = explainSvg('rect', {x: pad + j * size, y: pad + i * size, width: size, height: size,
                                  fill: w === null ? '#eee' : shade(w), class: 'explain-cell',
                                  'data-query': i, 'data-key': j});
    const tip = explainSvg('title'); tip.textContent = 'query ' + i + ', key ' + j + ': weight ' + explainFmt(w);
    r.appendChild(tip);
    r.style.cursor = 'pointer';
    r.addEventListener('click', () => pick(r, i, j));
    s.appendChild(r);
    if (i === n - 1 && j === Math.max(0, n - 2)) first = [r, i, j];
  }
  const row = explainNode('div', {class: 'plots'});
  const left = explainNode('div');
  left.append(s, explainNode('p', {class: 'facts'}, 'Pattern of the first ' + n + ' tokens (rows: queries, columns: keys; dark = high weight).'));
  row.append(left, out);
  sec.appendChild(row);
  if (first) pick(...first);
}
// ---- end Explain one score ----
