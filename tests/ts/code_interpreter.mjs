// npm @e2b/code-interpreter (pinned in package.json) against forkyard's code-interpreter-v1
// (run by tests/test_code_interpreter.py with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY
// pointing at the server, after the template is built). Prints {"ok": true} on success;
// any failure exits non-zero with the error.
import { Sandbox } from '@e2b/code-interpreter'

const assert = (cond, msg) => { if (!cond) throw new Error(`assertion failed: ${msg}`) }

const sbx = await Sandbox.create({ timeoutMs: 120_000 }) // the SDK's default template
try {
  await sbx.runCode('x = 20')
  const stdout = []
  const ex = await sbx.runCode('print("from python")\nx * 2 + 2', { onStdout: (m) => stdout.push(m.line) })
  assert(ex.text === '42', `stateful run: ${JSON.stringify(ex.toJSON())}`)
  assert(ex.logs.stdout.join('') === 'from python\n' && stdout.length === 1, `stdout: ${JSON.stringify(ex.logs)}`)

  const bad = await sbx.runCode('undefined_name')
  assert(bad.error && bad.error.name === 'NameError', `error: ${JSON.stringify(bad.error)}`)

  const chart = await sbx.runCode('import matplotlib.pyplot as plt\nplt.bar(["a", "b"], [3, 5])\nplt.show()')
  assert(chart.results[0].png && chart.results[0].chart.type === 'bar', 'chart result')

  const js = await sbx.runCode('[1, 2, 3].reduce((a, b) => a + b)', { language: 'js' })
  assert(js.text === '6', `javascript: ${JSON.stringify(js.toJSON())}`)

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  const inCtx = await sbx.runCode('import os; os.getcwd()', { context: ctx })
  assert(inCtx.text === '/tmp', `context cwd: ${inCtx.text}`)
  assert((await sbx.listCodeContexts()).some((c) => c.id === ctx.id), 'listed')
  await sbx.removeCodeContext(ctx)
  assert(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id), 'removed')
} finally {
  await sbx.kill()
}
console.log(JSON.stringify({ ok: true }))
