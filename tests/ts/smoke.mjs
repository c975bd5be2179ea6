// E2B JavaScript/TypeScript SDK smoke test against forkyard (run by tests/test_ts_sdk.py with
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY pointing at the server). Prints one JSON
// line of results on success; any failure exits non-zero with the error.
import { Sandbox } from 'e2b'

const assert = (cond, msg) => { if (!cond) throw new Error(`assertion failed: ${msg}`) }
const out = {}

const sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
try {
  out.sandboxId = sbx.sandboxId
  const r = await sbx.commands.run('echo hello from $(whoami)')
  assert(r.exitCode === 0 && r.stdout === 'hello from user\n', `run: ${JSON.stringify(r)}`)

  await sbx.files.write('/home/user/ts.txt', 'typescript')
  assert((await sbx.files.read('/home/user/ts.txt')) === 'typescript', 'files read back')
  const listed = await sbx.files.list('/home/user')
  assert(listed.some((e) => e.name === 'ts.txt'), 'files.list')

  let ptyOut = ''
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { ptyOut += new TextDecoder().decode(d) } })
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((6*7))\nexit\n'))
  await pty.wait().catch(() => {})
  assert(ptyOut.includes('pty-42'), `pty output: ${JSON.stringify(ptyOut.slice(-200))}`)

  assert((await sbx.isRunning()) === true, 'isRunning before pause')
  out.host = sbx.getHost(8000)
  assert(out.host === `8000-${sbx.sandboxId}.${process.env.FORKYARD_EXPECT_DOMAIN}`, `getHost: ${out.host}`)

  await sbx.pause()
  assert((await sbx.isRunning()) === false, 'isRunning after pause is false')
  const again = await Sandbox.connect(sbx.sandboxId)
  assert((await again.isRunning()) === true, 'isRunning after connect')
  assert((await again.files.read('/home/user/ts.txt')) === 'typescript', 'file survives pause')
  const r2 = await again.commands.run('echo back')
  assert(r2.stdout === 'back\n', 'run after connect')

  // Filesystem-only pause (keepMemory: false): files kept, processes gone, a new boot.
  const bg = await again.commands.run('sleep 1000', { background: true })
  const boot = (await again.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
  await again.pause({ keepMemory: false })
  const cold = await Sandbox.connect(sbx.sandboxId)
  assert((await cold.files.read('/home/user/ts.txt')) === 'typescript', 'file survives an fs-only pause')
  assert(!(await cold.commands.list()).some((p) => p.pid === bg.pid), 'process gone after an fs-only pause')
  assert((await cold.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout !== boot, 'new boot id')
  out.fsPause = true
} finally {
  await Sandbox.kill(sbx.sandboxId)
}
assert((await sbx.isRunning()) === false, 'isRunning after kill is false')
out.ok = true
console.log(JSON.stringify(out))
