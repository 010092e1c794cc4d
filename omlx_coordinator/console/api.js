// Calls to the gateway, each with the tab's key; a failure carries the API's own message.

const STORE = "omlx.console.key";

export const key = {
  get: () => sessionStorage.getItem(STORE),
  set: (value) => sessionStorage.setItem(STORE, value),
  clear: () => sessionStorage.removeItem(STORE),
};

export class APIError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export function headers(extra = {}) {
  const k = key.get();
  return k ? { authorization: `Bearer ${k}`, ...extra } : extra;
}

export async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
  } catch { /* not JSON: the status line says it */ }
  return new APIError(response.status, message);
}

// GET or POST `path`; JSON or text back. `timeout` bounds it: no call waits forever.
export async function call(path, { method = "GET", body, timeout = 15000 } = {}) {
  const init = { method, signal: AbortSignal.timeout(timeout),
                 headers: headers(body === undefined ? {} : { "content-type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new APIError(0, e.name === "TimeoutError" ? `${path}: no answer in ${timeout / 1000} s`
                                                    : `${path}: the gateway is unreachable`);
  }
  if (!response.ok) throw await failure(response);
  const type = response.headers.get("content-type") ?? "";
  return type.includes("json") ? response.json() : response.text();
}
