package provider

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
)

// TestPersistFailureSurfaced: when status.json cannot be written (here a
// directory stands where its temporary file goes; the tests run as root, so
// a read-only dir would not stop the write) the stale record that claims
// the VM still runs is removed, and the pod gets a Warning event naming
// the failure; when writing works again the record is current and a
// Normal event says so.
func TestPersistFailureSurfaced(t *testing.T) {
	dir := t.TempDir()
	rec := record.NewFakeRecorder(100)
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, Recorder: rec})
	pod := podtest.VMPod()
	run := p.newRun(pod)
	r := run.rec
	require.NoError(t, os.MkdirAll(r.dir, 0o700))
	statusPath := filepath.Join(r.dir, StatusFileName)

	run.update(func(st *podstatus.VMState) { st.SetRunning(time.Now()) })
	var onDisk podstatus.VMState
	b, err := os.ReadFile(statusPath)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &onDisk))
	require.NotNil(t, onDisk.Running, "the first write records Running")
	require.Empty(t, drainEvents(rec))

	// Break the write, then record that the VM ended.
	blocker := statusPath + ".tmp"
	require.NoError(t, os.MkdirAll(filepath.Join(blocker, "x"), 0o700))
	run.update(func(st *podstatus.VMState) {
		st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 1, Reason: "Error"})
	})
	if b, err := os.ReadFile(statusPath); err == nil {
		var st podstatus.VMState
		require.NoError(t, json.Unmarshal(b, &st))
		assert.Nil(t, st.Running, "status.json still claims the VM runs after a failed write: %s", b)
	}
	evs := drainEvents(rec)
	require.Len(t, evs, 1, "one Warning event for the failure: %v", evs)
	assert.True(t, strings.HasPrefix(evs[0], "Warning FailedToRecordState "), evs[0])
	assert.Contains(t, evs[0], StatusFileName)

	// A second failure in the same streak logs but sends no new event.
	run.update(func(st *podstatus.VMState) { st.RestartCount++ })
	assert.Empty(t, drainEvents(rec))

	// Writing works again: the record is the current state.
	require.NoError(t, os.RemoveAll(blocker))
	run.update(func(st *podstatus.VMState) { st.RestartCount++ })
	b, err = os.ReadFile(statusPath)
	require.NoError(t, err)
	onDisk = podstatus.VMState{}
	require.NoError(t, json.Unmarshal(b, &onDisk))
	assert.Nil(t, onDisk.Running)
	require.NotNil(t, onDisk.Terminated)
	assert.Equal(t, int32(1), onDisk.Terminated.ExitCode)
	assert.Equal(t, int32(2), onDisk.RestartCount)
	evs = drainEvents(rec)
	require.Len(t, evs, 1, "%v", evs)
	assert.True(t, strings.HasPrefix(evs[0], "Normal RecordedState "), evs[0])
}
