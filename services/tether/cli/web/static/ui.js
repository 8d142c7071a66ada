// tether ui: the token under the pointer, spelled out in a bar at the bottom of a rollout page (the same
// figures as the token's title). No library, no network.
document.addEventListener("DOMContentLoaded", () => {
  const tokens = document.querySelectorAll(".tok[data-token-id]");
  if (!tokens.length) return;
  const info = document.createElement("div");
  info.id = "token-info";
  info.textContent = "hover a token";
  document.body.appendChild(info);
  for (const tok of tokens) {
    tok.addEventListener("mouseenter", () => { info.textContent = tok.title; });
  }
});
