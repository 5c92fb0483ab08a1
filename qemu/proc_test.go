package qemu

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestParseSmapsRollup(t *testing.T) {
	good := `55d0c0000000-7ffd4e5f1000 ---p 00000000 00:00 0                          [rollup]
Rss:              209920 kB
Pss:              204800 kB
Pss_Dirty:        186368 kB
Pss_Anon:         186000 kB
Shared_Clean:       8192 kB
Anonymous:        186368 kB
Swap:                  0 kB
`
	rss, pss, anon, err := parseSmapsRollup([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if rss != 209920<<10 || pss != 204800<<10 || anon != 186368<<10 {
		t.Fatalf("rss %d pss %d anon %d", rss, pss, anon)
	}
	for name, bad := range map[string]string{
		"empty":        "",
		"no pss":       "Rss: 10 kB\nAnonymous: 5 kB\n",
		"not a number": "Rss: 10 kB\nPss: x kB\nAnonymous: 5 kB\n",
		"negative":     "Rss: 10 kB\nPss: -1 kB\nAnonymous: 5 kB\n",
	} {
		if _, _, _, err := parseSmapsRollup([]byte(bad)); err == nil || !strings.Contains(err.Error(), "smaps_rollup") {
			t.Errorf("%s: want a smaps_rollup error, got %v", name, err)
		}
	}
}

// TestReadProcStatsSelf reads this test process: PSS and anonymous memory
// are filled and bounded by RSS.
func TestReadProcStatsSelf(t *testing.T) {
	st, err := readProcStats(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if st.RSSBytes <= 0 || st.PSSBytes <= 0 || st.AnonBytes <= 0 {
		t.Fatalf("stats not filled: %+v", st)
	}
	if st.PSSBytes > st.RSSBytes || st.AnonBytes > st.RSSBytes {
		t.Fatalf("pss %d or anon %d above rss %d", st.PSSBytes, st.AnonBytes, st.RSSBytes)
	}
	if _, err := readProcStats(1 << 30); err == nil {
		t.Fatal("want an error for a pid that does not exist")
	}
}

// TestKillStale: the process a state dir's pidfile names is killed when
// its command line names the dir's QMP socket (a QEMU of that dir), and
// left alone otherwise (a reused pid); no pidfile is nothing to do, a
// garbled one an error naming it.
func TestKillStale(t *testing.T) {
	dir := t.TempDir()
	require := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	require(KillStale(dir, time.Second)) // no pidfile
	start := func(args ...string) *exec.Cmd {
		t.Helper()
		// sh waits reading a pipe that stays open: one process, whose
		// command line carries args.
		r, w, err := os.Pipe()
		require(err)
		cmd := exec.Command("sh", append([]string{"-c", "read x", "sh"}, args...)...)
		cmd.Stdin = r
		require(cmd.Start())
		r.Close()
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait(); w.Close() })
		require(os.WriteFile(filepath.Join(dir, PidfileName), []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o600))
		return cmd
	}

	other := start("-name", "not-this-dir")
	require(KillStale(dir, time.Second))
	if !processRuns(other.Process.Pid) {
		t.Fatalf("pid %d, not a QEMU of %s, was killed", other.Process.Pid, dir)
	}

	ours := start("-qmp", "unix:"+filepath.Join(dir, QMPSocketName)+",server=on")
	if !qemuAlive(ours.Process.Pid, dir) {
		t.Fatalf("pid %d does not pass for a QEMU of %s", ours.Process.Pid, dir)
	}
	require(KillStale(dir, 10*time.Second))
	if qemuAlive(ours.Process.Pid, dir) {
		t.Fatalf("pid %d still alive after KillStale", ours.Process.Pid)
	}
	if err := ours.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("pid %d: want killed, got %v", ours.Process.Pid, err)
	}

	require(os.WriteFile(filepath.Join(dir, PidfileName), []byte("not a pid"), 0o600))
	if err := KillStale(dir, time.Second); err == nil || !strings.Contains(err.Error(), PidfileName) {
		t.Fatalf("garbled pidfile: want an error naming it, got %v", err)
	}
}

// processRuns: pid is a live process (not a zombie).
func processRuns(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i > 0 && len(b) > i+2 && b[i+2] != 'Z'
}
