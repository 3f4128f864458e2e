// The console's only script, served from the admin listener (its pages allow no other, and no
// inline script). Forms marked `data-post` send JSON to the admin API, the same endpoints
// `curl` uses, after their confirmation step when they have one; a `data-refresh` element is
// redrawn from its address every five seconds.
'use strict';

function withFields(form, body) {
  for (const input of form.querySelectorAll('[data-field]')) {
    const value = input.value.trim();
    body[input.dataset.field] = input.type === 'number' ? Number(value) : value;
  }
  return body;
}

async function send(form) {
  const out = form.querySelector('output');
  const body = withFields(form, JSON.parse(form.dataset.body || '{}'));
  let response;
  try {
    response = await fetch(form.dataset.post, {
      method: 'POST',
      credentials: 'same-origin',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(body),
    });
  } catch (error) {
    if (out) out.textContent = 'The request failed: ' + error;
    return;
  }
  if (response.ok) {
    const then = form.dataset.then;
    if (then === 'reload') {
      // What the admin API answered (the buckets after the change), shown after the reload.
      let note = form.dataset.done || 'Done';
      try {
        const answer = await response.json();
        const states = (answer.buckets || []).map((b) => `${b.name} ${b.tokens} of ${b.capacity} tokens`);
        if (states.length) note += ': ' + states.join(', ') + '.';
      } catch (_) {
        // No JSON: the note alone.
      }
      sessionStorage.setItem('tollgate-flash', note);
      location.reload();
    } else if (then) {
      location.assign(then);
    } else if (out) {
      out.textContent = 'Done.';
    }
    return;
  }
  let message = response.status + ' ' + response.statusText;
  try {
    message = (await response.json()).error || message;
  } catch (_) {
    // Not JSON: the status says it.
  }
  if (out) out.textContent = message;
}

document.addEventListener('DOMContentLoaded', () => {
  const flash = document.getElementById('flash');
  const note = sessionStorage.getItem('tollgate-flash');
  if (flash && note) {
    flash.textContent = note;
    flash.hidden = false;
  }
  sessionStorage.removeItem('tollgate-flash');
  for (const form of document.querySelectorAll('form[data-post]')) {
    const confirmation = form.querySelector('.confirm');
    const ask = form.querySelector('.ask');
    const cancel = form.querySelector('.cancel');
    if (ask && confirmation) ask.addEventListener('click', () => { confirmation.hidden = false; });
    if (cancel && confirmation) cancel.addEventListener('click', () => { confirmation.hidden = true; });
    form.addEventListener('submit', (event) => {
      event.preventDefault();
      // Enter in a field must not skip the confirmation.
      if (confirmation && confirmation.hidden) {
        confirmation.hidden = false;
        return;
      }
      send(form);
    });
  }
  for (const element of document.querySelectorAll('[data-refresh]')) {
    setInterval(async () => {
      try {
        const response = await fetch(element.dataset.refresh, { credentials: 'same-origin' });
        if (response.ok) element.innerHTML = await response.text();
      } catch (_) {
        // The listener is away (a restart): the next tick tries again.
      }
    }, 5000);
  }
});
