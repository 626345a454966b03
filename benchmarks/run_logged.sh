# Sourced by the GPU check scripts: `run NAME COMMAND...` logs COMMAND to $OUT/NAME.log, prints
# its time, and on failure its last lines, and keeps going (the script exits with $status at the end).
status=0
run() {
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok in $((SECONDS - t0)) s"; else
        echo "   FAILED ($?) in $((SECONDS - t0)) s; last lines:"; tail -n 40 "$OUT/$name.log"; status=1; fi
}
