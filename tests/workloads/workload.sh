#!/bin/bash
# What an agent does in a `base` sandbox, as one script (tests/workloads/test_workloads.py
# runs it inside sandboxes and in a host chroot of the same rootfs). Each step prints
# "ok STEP MS"; the first failing step stops the script with "FAILED STEP" and exits 1.
#
# Environment: WL_TAG (names this run's files: runs do not collide), WL_INDEX (base URL of
# the test's package index: /simple/ (PEP 503) and /files/), WL_PORT (first of five ports
# for the servers step). Runs as `user`; root steps go through sudo.
set -uo pipefail
: "${WL_TAG:?}" "${WL_INDEX:?}" "${WL_PORT:?}"
W=$HOME/wl-$WL_TAG
mkdir -p "$W"
cd "$W" || exit 1

step() {  # step NAME FUNCTION
  local t0 out rc
  t0=$(date +%s%N)
  out=$("$2" 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAILED $1 (exit $rc)"
    printf '%s\n' "$out" | tail -n 30
    exit 1
  fi
  echo "ok $1 $(( ($(date +%s%N) - t0) / 1000000 ))"
}

c_programs() {  # dynamic and static builds, run from ~ and from /usr/local/bin
  cat > hello.c <<'EOF'
#include <stdio.h>
int main(int argc, char **argv) { printf("hello %s\n", argc > 1 ? argv[1] : "world"); return 0; }
EOF
  gcc -O1 -o hello hello.c && gcc -O1 -static -o hello-static hello.c || return 1
  [ "$(./hello a)" = "hello a" ] && [ "$("$W/hello-static" b)" = "hello b" ] || return 1
  sudo install -m 0755 hello "/usr/local/bin/wl-hello-$WL_TAG" || return 1
  sudo install -m 0755 hello-static "/usr/local/bin/wl-hello-static-$WL_TAG" || return 1
  [ "$("wl-hello-$WL_TAG" c)" = "hello c" ] && [ "$("wl-hello-static-$WL_TAG" d)" = "hello d" ]
}

copied_binaries() {  # a copied system binary, and an image file hard-linked (copied up)
  cp /bin/true ./true && ./true || return 1
  cp /usr/bin/python3 ./py && [ "$(./py -c 'print(6*7)')" = 42 ] || return 1
  sudo ln -f /usr/bin/gzip "/usr/local/bin/wl-gz-$WL_TAG" || return 1
  [ "$(echo linked | /usr/bin/gzip | "wl-gz-$WL_TAG" -d)" = linked ]
}

shared_library() {  # a .so built here, loaded by ctypes
  cat > add.c <<'EOF'
int wl_add(int a, int b) { return a + b; }
EOF
  gcc -shared -fPIC -o libwladd.so add.c || return 1
  [ "$(python3 -c "import ctypes; print(ctypes.CDLL('$W/libwladd.so').wl_add(40, 2))")" = 42 ]
}

make_project() {  # make -j2 of a multi-file C project
  mkdir -p proj && cd proj || return 1
  for i in 1 2 3 4 5 6; do
    printf 'int f%s(void) { return %s; }\n' "$i" "$i" > "f$i.c"
  done
  cat > main.c <<'EOF'
#include <stdio.h>
int f1(void); int f2(void); int f3(void); int f4(void); int f5(void); int f6(void);
int main(void) { printf("%d\n", f1() + f2() + f3() + f4() + f5() + f6()); return 0; }
EOF
  printf 'OBJS = main.o f1.o f2.o f3.o f4.o f5.o f6.o\nsum: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n%%.o: %%.c\n\t$(CC) -O1 -c -o $@ $<\n' > Makefile
  make -j2 -s && [ "$(./sum)" = 21 ]
}

c_extension() {  # a Python C extension module built against the headers, imported
  cat > wlspam.c <<'EOF'
#include <Python.h>
static PyObject *twice(PyObject *self, PyObject *args) {
  long n; if (!PyArg_ParseTuple(args, "l", &n)) return NULL; return PyLong_FromLong(2 * n);
}
static PyMethodDef methods[] = {{"twice", twice, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "wlspam", NULL, -1, methods};
PyMODINIT_FUNC PyInit_wlspam(void) { return PyModule_Create(&mod); }
EOF
  gcc -shared -fPIC $(python3-config --includes) -o "wlspam$(python3-config --extension-suffix)" wlspam.c || return 1
  [ "$(python3 -c 'import wlspam; print(wlspam.twice(21))')" = 42 ]
}

venv_pip() {  # a venv with copied binaries; pip installs a pure and a compiled wheel into it
  local host=${WL_INDEX#*://}
  # (--without-pip: the system pip installs into the venv; ensurepip would add 10-20 s)
  python3 -m venv --copies --without-pip venv || return 1
  python3 -m pip --python venv/bin/python install -q --no-cache-dir --disable-pip-version-check \
    --index-url "$WL_INDEX/simple/" --trusted-host "${host%%/*}" wlpure wlcext || return 1
  [ "$(venv/bin/python -c 'import wlpure, wlcext; print(wlpure.answer(), wlcext.twice(21))')" = "42 42" ]
}

npm_package() {  # an npm package from a tarball, its bin and require()
  mkdir -p npmproj && cd npmproj || return 1
  curl -fsS -o wl-pkg.tgz "$WL_INDEX/files/wl-pkg-1.0.0.tgz" || return 1
  npm init -y >/dev/null && npm install --no-audit --no-fund --offline ./wl-pkg.tgz >/dev/null || return 1
  [ "$(node -e 'console.log(require("wl-pkg").answer())')" = 42 ] && [ "$(./node_modules/.bin/wl-pkg)" = "wl-pkg 42" ]
}

git_repo() {  # a 2,000-file repo made in /tmp, cloned to ~ (hard links across), commit/status/diff
  local repo=/tmp/wl-repo-$WL_TAG
  rm -rf "$repo" && mkdir -p "$repo" || return 1
  python3 - "$repo" <<'EOF' || return 1
import os, sys
for i in range(2000):
    d = os.path.join(sys.argv[1], f"d{i // 100}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i}.txt"), "w") as f:
        f.write(f"line {i}\n")
EOF
  git -C "$repo" init -q && git -C "$repo" add -A && git -C "$repo" -c user.name=wl -c user.email=wl@x commit -qm init || return 1
  git clone -q --local "$repo" clone && cd clone || return 1
  [ "$(git ls-files | wc -l)" = 2000 ] || return 1
  echo changed >> d3/f300.txt
  [ "$(git status --porcelain)" = " M d3/f300.txt" ] && git diff | grep -q '^+changed$' || return 1
  git -c user.name=wl -c user.email=wl@x commit -qam change && [ -z "$(git status --porcelain)" ] || return 1
  rm -rf "$repo"
}

shebang_scripts() {  # chmod +x scripts with #! lines
  printf '#!/bin/bash\necho "sh $1"\n' > s.sh && printf '#!/usr/bin/env python3\nprint("py", 6 * 7)\n' > s.py
  chmod +x s.sh s.py && [ "$(./s.sh x)" = "sh x" ] && [ "$(./s.py)" = "py 42" ]
}

tmp_on_disk() {  # /tmp and ~ are one filesystem: a 200 MiB file, mv and ln across
  head -c 200M /dev/zero > "/tmp/wl-big-$WL_TAG" && mv "/tmp/wl-big-$WL_TAG" big || return 1
  ln big "/tmp/wl-link-$WL_TAG" && [ "$(stat -c %h big)" = 2 ] && [ "$(stat -c %s big)" = 209715200 ] || return 1
  rm -f big "/tmp/wl-link-$WL_TAG"
}

sqlite_db() {
  python3 - "$W/wl.db" <<'EOF'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("create table t (k integer primary key, v text)")
with db:
    db.executemany("insert into t (v) values (?)", [(f"v{i}",) for i in range(1000)])
for _ in range(20):
    with db:
        db.execute("update t set v = v || 'x' where k % 7 = 0")
n, = db.execute("select count(*) from t where v like '%x'").fetchone()
assert n == 142, n
db.close()
EOF
}

multiprocessing_pool() {
  python3 - <<'EOF'
from multiprocessing import Pool
with Pool(2) as p:
    assert sum(p.map(abs, range(-100, 0))) == 5050
EOF
}

servers() {  # HTTP servers on each address; left running for the caller to reach
  local i=0 a
  for a in 0.0.0.0 :: 127.0.0.1 localhost ::1; do
    mkdir -p "www$i" && echo "served $a" > "www$i/index.html"
    (cd "www$i" && exec setsid python3 -m http.server "$((WL_PORT + i))" --bind "$a") </dev/null >"server$i.log" 2>&1 &
    i=$((i + 1))
  done
  local deadline=$((SECONDS + 30)) url
  for i in 0 1 2 3 4; do
    url=http://127.0.0.1:$((WL_PORT + i))/
    [ $i -eq 4 ] && url="http://[::1]:$((WL_PORT + i))/"
    [ $i -eq 3 ] && url=http://localhost:$((WL_PORT + i))/
    until curl -fsS -m 2 "$url" >/dev/null 2>&1; do
      [ $SECONDS -lt $deadline ] || { echo "no server on $url"; tail -n 5 server*.log; return 1; }
      sleep 0.1
    done
  done
}

step c_programs c_programs
step copied_binaries copied_binaries
step shared_library shared_library
step make_project make_project
step c_extension c_extension
step venv_pip venv_pip
step npm_package npm_package
step git_repo git_repo
step shebang_scripts shebang_scripts
step tmp_on_disk tmp_on_disk
step sqlite sqlite_db
step multiprocessing multiprocessing_pool
step servers servers
echo "all ok"
