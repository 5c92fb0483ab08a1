package provider

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestViewAndLogErrors: the lookups behind logs/attach/exec/port-forward
// on a pod record (no VM).
func TestViewAndLogErrors(t *testing.T) {
	ctx := context.Background()
	p := NewVMs(ctx, VMsConfig{NodeName: "n1"})
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
	run := p.newRun(pod)
	rec := run.rec
	rec.dir = t.TempDir()
	rec.state.SetWaiting(podstatus.ReasonErrImagePull, "nope")
	p.pods[pod.UID] = run

	_, err := p.GetContainerLogs(ctx, "ns", "web", "vm", api.ContainerLogOpts{})
	require.Error(t, err)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Equal(t, `container "vm" in pod "web" is waiting to start: ErrImagePull`, err.Error())

	_, err = p.GetContainerLogs(ctx, "ns", "web", "other", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "container other is not valid for pod web")
	_, err = p.GetContainerLogs(ctx, "ns", "nope", "vm", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsNotFound(err))

	err = p.AttachToContainer(ctx, "ns", "web", "vm", nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "its VM is not running")
	err = p.RunInContainer(ctx, "ns", "web", "vm", []string{"ls"}, nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "exec in pod ns/web: its VM is not running")
	s1, s2 := testutil.TCPPair(t)
	_ = s2
	err = p.PortForward(ctx, "ns", "web", 80, s1)
	assert.True(t, errdefs.IsInvalidInput(err))

	// A VM ran once (now in back-off): logs show what it wrote.
	rec.state.Started = true
	rec.state.SetWaiting(podstatus.ReasonCrashLoopBackOff, "")
	writeConsole(t, rec.dir, qemu.ConsoleLogName, "last run\n", time.Now())
	rc, err := p.GetContainerLogs(ctx, "ns", "web", "", api.ContainerLogOpts{})
	require.NoError(t, err)
	b, _ := io.ReadAll(rc)
	rc.Close()
	assert.Equal(t, "last run\n", string(b))
}

func writeConsole(t *testing.T, dir, name, content string, mtime time.Time) {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	require.NoError(t, os.Chtimes(p, mtime, mtime))
}
