# shellcheck shell=sh
# The prelude of the scripts that answer in sections: fleet/remote/__init__.py's script() puts it in
# place of their `# fleet: include prelude.sh` line, so each stays one text on the wire. Their one
# framing (read by fleet.remote.parse_answers):
#   @@fleet <name> <exit code> <lines>
#   <lines> lines: what the command printed, stdout + stderr
# The line count makes the framing safe for any text: a log line that starts with `@@fleet` inside
# a section is read as text, never as the next header (byte counts would not survive the caller's
# UTF-8 decoding of a log with invalid bytes; newlines do). The script sets timeout_s (seconds per
# limited call) and, for smi_section, smi (the nvidia-smi command) before calling those.
# POSIX sh (dash on Debian/Proxmox).
# shellcheck disable=SC2154  # timeout_s and smi are the including script's
if command -v timeout >/dev/null 2>&1; then has_timeout=1; else has_timeout=0; fi
limited() {  # limited COMMAND...: under `timeout $timeout_s` where the target has timeout(1)
    if [ "$has_timeout" = 1 ]; then timeout -k 2 "$timeout_s" "$@"; else "$@"; fi
}
fleet_nl='
'
emit() {  # emit NAME EXIT_CODE TEXT: TEXT (trailing newlines aside) as one section
    case $3 in
        *"$fleet_nl"*) fleet_lines=$(($(printf '%s\n' "$3" | wc -l))) ;;
        *) fleet_lines=1 ;;  # most answers are one line: no fork to count them
    esac
    printf '@@fleet %s %s %s\n%s\n' "$1" "$2" "$fleet_lines" "$3"
}
section() {  # section NAME COMMAND...: the command's output and exit code (also left in $out, $rc)
    name=$1
    shift
    out=$("$@" 2>&1) && rc=0 || rc=$?  # also under set -e
    emit "$name" "$rc" "$out"
}
tail_section() {  # tail_section NAME BYTES FILE: FILE's last BYTES bytes (nothing where unreadable)
    # Buffered by awk, not a shell variable: dash takes ~10x longer for a 256 KiB command
    # substitution, and the lines must be counted before they are printed (a log may grow).
    tail -c "$2" -- "$3" 2>/dev/null |
        awk -v head="@@fleet $1 0" '{ line[NR] = $0 } END { print head, NR; for (i = 1; i <= NR; i++) print line[i] }'
}
smi_section() {  # smi_section NAME ARGS...: nvidia-smi ARGS under the timeout (also $out, $rc)
    name=$1
    shift
    out=$(limited "$smi" "$@" 2>&1) && rc=0 || rc=$?
    emit "$name" "$rc" "$out"
}
