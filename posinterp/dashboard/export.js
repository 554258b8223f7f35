// Download buttons for a head card (SVG and PNG), built in the page itself: the SVG is
// serialized from the card's plots and the PNG drawn from it on a canvas, so nothing is
// fetched. Shared by the inspect and compare pages; a MutationObserver adds the buttons
// each time the page's script redraws #card (the card code needs no change).
(function () {
  const NS = 'http://www.w3.org/2000/svg';
  const STYLE = 'text { font: 10px sans-serif; fill: #333; }';
  function stem(card) {
    const h = card.querySelector('h2');
    const words = (h ? h.textContent : 'head').match(/[A-Za-z0-9.]+/g) || ['head'];
    return 'posinterp-' + words.join('-').toLowerCase();
  }
  function cardSVG(card) {
    const plots = Array.from(card.querySelectorAll('.plots svg'));
    const lines = [];
    const h = card.querySelector('h2');
    if (h) lines.push(h.textContent);
    for (const tr of card.querySelectorAll('table.scores tr'))
      lines.push(Array.from(tr.children).map(c => c.textContent).join('   '));
    const W = Math.max(760, ...plots.map(p => +p.getAttribute('width') || 0));
    let x = 0, y = 16 * lines.length + 12, rowH = 0;
    const placed = [];
    for (const p of plots) {
      const w = +p.getAttribute('width') || 300, ht = +p.getAttribute('height') || 150;
      if (x > 0 && x + w > W) { x = 0; y += rowH + 8; rowH = 0; }
      placed.push([p, x, y]);
      x += w + 8; rowH = Math.max(rowH, ht);
    }
    const H = y + rowH + 8;
    const out = document.createElementNS(NS, 'svg');
    out.setAttribute('xmlns', NS);
    out.setAttribute('width', W); out.setAttribute('height', H);
    out.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
    const style = document.createElementNS(NS, 'style'); style.textContent = STYLE; out.appendChild(style);
    const bg = document.createElementNS(NS, 'rect');
    for (const [a, v] of [['width', W], ['height', H], ['fill', '#fff']]) bg.setAttribute(a, v);
    out.appendChild(bg);
    lines.forEach((s, i) => {
      const t = document.createElementNS(NS, 'text');
      t.setAttribute('x', 4); t.setAttribute('y', 14 + 16 * i);
      if (i === 0) t.setAttribute('style', 'font-weight: bold; font-size: 13px');
      t.textContent = s; out.appendChild(t);
    });
    for (const [p, px, py] of placed) {
      const c = p.cloneNode(true);
      c.setAttribute('x', px); c.setAttribute('y', py);
      out.appendChild(c);
    }
    return new XMLSerializer().serializeToString(out);
  }
  function save(blob, name) {
    if (typeof window.POSINTERP_SAVE === 'function') return window.POSINTERP_SAVE(blob, name);
    const a = document.createElement('a');
    a.href = URL.createObjectURL(blob); a.download = name;
    document.body.appendChild(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 2000);
  }
  function toPNG(text, scale, done) {
    const img = new Image();
    img.onload = () => {
      const c = document.createElement('canvas');
      c.width = Math.round(img.width * scale); c.height = Math.round(img.height * scale);
      const g = c.getContext('2d');
      g.fillStyle = '#fff'; g.fillRect(0, 0, c.width, c.height);
      g.drawImage(img, 0, 0, c.width, c.height);
      c.toBlob(done, 'image/png');
    };
    img.src = 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(text);
  }
  function addButtons(card) {
    if (card.querySelector('.export-bar') || !card.querySelector('.plots svg')) return;
    const bar = document.createElement('div');
    bar.className = 'export-bar';
    bar.setAttribute('style', 'float: right; display: flex; gap: 0.4em;');
    const mk = (label, cls, fn) => {
      const b = document.createElement('button');
      b.className = cls; b.textContent = label; b.title = 'download this card\'s plots and scores';
      b.onclick = fn; bar.appendChild(b);
    };
    mk('SVG', 'export-svg', () => save(new Blob([cardSVG(card)], {type: 'image/svg+xml'}), stem(card) + '.svg'));
    mk('PNG', 'export-png', () => toPNG(cardSVG(card), 2, blob => save(blob, stem(card) + '.png')));
    card.insertBefore(bar, card.firstChild);
  }
  const card = document.getElementById('card');
  if (!card) return;
  new MutationObserver(() => addButtons(card)).observe(card, {childList: true});
  addButtons(card);
  window.POSINTERP_CARD_SVG = () => cardSVG(card);
})();
