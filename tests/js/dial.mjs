// Dial a libp2p peer, wait for its identify answer, ping it; print what it said as one JSON line.
// Usage: node dial.mjs /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID
import './node20.mjs'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const target = multiaddr(process.argv[2])
const node = await createLibp2p({
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), ping: ping() }
})
await node.start()
const timeout = setTimeout(() => { console.error('timed out'); process.exit(2) }, 20000)
const identified = new Promise((resolve) => {
  node.addEventListener('peer:identify', (evt) => resolve(evt.detail))
})
await node.dial(target)
const info = await identified
const rtts = []
for (let i = 0; i < 3; i++) rtts.push(await node.services.ping.ping(target))
console.log(JSON.stringify({
  peerId: info.peerId.toString(),
  protocols: info.protocols,
  agentVersion: info.agentVersion,
  listenAddrs: info.listenAddrs.map(String),
  pingMs: rtts
}))
clearTimeout(timeout)
await node.stop()
