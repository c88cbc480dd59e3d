#!/usr/bin/env bash
# Wait up to SECONDS for ~/res/JOB.log to say "== done", packing ~/res into $OUT/res.tgz as it goes (what is
# there comes back even if the call or the device time runs out; one archive, since the device tool brings back
# only the first few files of $OUT); then MLX's kernel cache as ptx.tgz and the tail of every log. A further call
# with the same arguments waits for the rest: bash benchmarks/device/wait.sh SECONDS JOB
end=$((SECONDS + $1))
while [ $SECONDS -lt $end ] && ! grep -q "^== done" ~/res/"$2".log 2>/dev/null; do
  sleep 10
  tar czf "$OUT"/res.tgz -C ~/res . 2>/dev/null
done
tar czf "$OUT"/res.tgz -C ~/res . 2>/dev/null
[ -d ~/ptx ] && tar czf "$OUT"/ptx.tgz -C ~/ptx .  # MLX's kernel cache, for the next lease (install.sh)
for f in ~/res/*.log; do echo "#### $f"; tail -c 4000 "$f"; done
