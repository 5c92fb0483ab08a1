package vmtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestDiagnose: the description of a VM's state dir carries the exit
// record and the console's last lines (not the earlier ones), and says
// when no QEMU runs.
func TestDiagnose(t *testing.T) {
	dir := t.TempDir()
	var console strings.Builder
	for i := 1; i <= 50; i++ {
		fmt.Fprintf(&console, "console line %02d\n", i)
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, qemu.ConsoleLogName), []byte(console.String()), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, qemu.ExitFileName), []byte(`{"class": "panicked"}`+"\n"), 0o600))

	d := Diagnose(dir)
	assert.Contains(t, d, "QEMU: no process running")
	assert.Contains(t, d, `exit record exit.json: {"class": "panicked"}`)
	assert.Contains(t, d, "console line 50")
	assert.Contains(t, d, "console line 21", "the last 30 lines")
	assert.NotContains(t, d, "console line 20", "only the last 30 lines")

	require.NoError(t, os.Remove(filepath.Join(dir, qemu.ExitFileName)))
	require.NoError(t, os.Remove(filepath.Join(dir, qemu.ConsoleLogName)))
	d = Diagnose(dir)
	assert.Contains(t, d, "exit record exit.json: open ")
	assert.Contains(t, d, "console: empty")
}

// TestProcSummary reads a live process's state and CPU time.
func TestProcSummary(t *testing.T) {
	s := procSummary(os.Getpid())
	assert.Regexp(t, `^state [RS], CPU user \d+\.\ds system \d+\.\ds$`, s)
	assert.Contains(t, procSummary(1<<30), "no such file")
}
