// A Node `http` server on the listening socket vigil holds, and on the generation's own
// unix socket (examples/node/serve). Answers `node pid=<pid> build=<its own sha256 prefix>`.
//
// Node does not read LISTEN_FDS: `listen({fd: 3})` takes the socket vigil holds (fd 3, the
// first --listen). It sends no READY=1, so readiness is `--ready http`: GET / on
// $VIGIL_SOCKET, served by a second listen on that path. SIGTERM: both servers stop
// accepting, what they accepted is answered, then the process exits (Node's default on
// SIGTERM is to die at once, failing what is in flight).
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const http = require("http");

const build = process.env.APP_BUILD ||
  crypto.createHash("sha256").update(fs.readFileSync(__filename)).digest("hex").slice(0, 12);

function handler(req, res) {
  const body = `node pid=${process.pid} build=${build}\n`;
  res.writeHead(200, { "Content-Type": "text/plain", "Content-Length": Buffer.byteLength(body) });
  res.end(body);
}

const servers = [http.createServer(handler), http.createServer(handler)];
servers[0].listen({ fd: 3 });
servers[1].listen(process.env.VIGIL_SOCKET);

process.on("SIGTERM", () => {
  let open = servers.length;
  for (const s of servers) {
    s.close(() => { if (--open === 0) process.exit(0); });
    s.closeIdleConnections();
  }
});
