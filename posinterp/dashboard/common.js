// Helpers shared by the inspect and compare pages (loaded before either page's script).
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [a, v] of Object.entries(attrs || {})) e.setAttribute(a, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [a, v] of Object.entries(attrs || {})) e.setAttribute(a, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return '';
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a < 1e-12) return '0';  // float64 rounding of an exact zero, not a value
  return (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : v.toFixed(3);
}
// A table in posinterp.dashboard.columns' encoding, as one object per row. A non-finite
// float (NaN, +-inf) is shown as missing (null), as the page always has.
function decodeTable(t) {
  const expand = (enc, kind) => {
    if (enc[kind + 's']) return enc[kind + 's'];
    const out = [];
    for (const [v, k] of enc[kind + '_runs']) for (let i = 0; i < k; i++) out.push(v);
    return out;
  };
  const cols = t.columns.map(c => {
    const enc = t.data[c];
    if (enc.float64 !== undefined) {
      const bin = atob(enc.float64), bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
      return Array.from(new Float64Array(bytes.buffer), v => (Number.isFinite(v) ? v : null));
    }
    if (enc.levels) return expand(enc, 'code').map(k => (k < 0 ? null : enc.levels[k]));
    return expand(enc, 'value');
  });
  const rows = new Array(t.n_rows);
  for (let i = 0; i < t.n_rows; i++) {
    const r = {};
    t.columns.forEach((c, j) => { r[c] = cols[j][i]; });
    rows[i] = r;
  }
  return rows;
}
