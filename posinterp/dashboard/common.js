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
