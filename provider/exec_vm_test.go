package provider

import (
	"bytes"
	"context"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/probe"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	utilexec "k8s.io/utils/exec"
)

// execIO is an api.AttachIO over buffers.
type execIO struct {
	stdin          io.Reader
	stdout, stderr bytes.Buffer
	tty            bool
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

func (e *execIO) Stdin() io.Reader            { return e.stdin }
func (e *execIO) Stdout() io.WriteCloser      { return nopCloser{&e.stdout} }
func (e *execIO) Stderr() io.WriteCloser      { return nopCloser{&e.stderr} }
func (e *execIO) TTY() bool                   { return e.tty }
func (e *execIO) Resize() <-chan api.TermSize { return nil }

// TestExecRealVM: kubectl exec's provider side and exec probes, through the
// test image's qemu-guest-agent on real QEMU.
func TestExecRealVM(t *testing.T) {
	testutil.SkipIfShort(t, "boots QEMU VMs")
	env := newVMEnv(t)
	root, refs := env.root, env.refs
	h := newHarness(t, env.stateDir, env.store, env.imageDir)
	ctx := context.Background()

	// A readiness probe that passes once /tmp/ready exists in the guest.
	pod := podFor("u-exec", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"test", "-e", "/tmp/ready"}}},
		PeriodSeconds: 1, TimeoutSeconds: 10, FailureThreshold: 1, SuccessThreshold: 1,
	}
	off := podFor("u-noagent", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{podspec.AnnotationKernelCmdline: "qk.noagent"})
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	require.NoError(t, h.vms.CreatePod(ctx, off))
	h.wait(pod.UID, 90*time.Second, "Running", running)
	h.wait(off.UID, 90*time.Second, "Running", running)
	waitConsole(t, filepath.Join(root, "state", VMsDirName, "u-exec"), "QK-AGENT-OK", 90*time.Second)
	waitConsole(t, filepath.Join(root, "state", VMsDirName, "u-noagent"), "QK-AGENT-OFF", 90*time.Second)

	t.Cleanup(func() { // no QEMU left behind
		for _, p := range []*corev1.Pod{pod, off} {
			if err := h.vms.DeletePod(ctx, deleting(p)); err != nil {
				t.Errorf("delete %s: %v", p.Name, err)
				continue
			}
			h.wait(p.UID, 60*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
			waitGoneDir(t, filepath.Join(root, "state", VMsDirName, string(p.UID)), 10*time.Second)
		}
	})
	exec := func(io *execIO, cmd ...string) error {
		return h.vms.RunInContainer(ctx, "default", pod.Name, "vm", cmd, io)
	}
	t.Run("ProbeFailsUntilTheFileExists", func(t *testing.T) {
		// Give the probe a few periods with the agent up: still not ready.
		time.Sleep(3 * time.Second)
		p, err := h.vms.GetPod(ctx, "default", pod.Name)
		require.NoError(t, err)
		assert.False(t, p.Status.ContainerStatuses[0].Ready)
		require.NoError(t, exec(&execIO{}, "touch", "/tmp/ready"))
		h.wait(pod.UID, 30*time.Second, "ready", func(p *corev1.Pod) bool { return p.Status.ContainerStatuses[0].Ready })
	})
	t.Run("UnameM", func(t *testing.T) {
		var io execIO
		require.NoError(t, exec(&io, "uname", "-m"))
		assert.Equal(t, string(qemu.HostArch())+"\n", io.stdout.String())
	})
	t.Run("Stdin", func(t *testing.T) {
		io := execIO{stdin: strings.NewReader("from stdin\n")}
		require.NoError(t, exec(&io, "tr", "a-z", "A-Z"))
		assert.Equal(t, "FROM STDIN\n", io.stdout.String())
	})
	t.Run("ExitCodeAndStderr", func(t *testing.T) {
		var io execIO
		err := exec(&io, "sh", "-c", "echo err >&2; exit 3")
		var ee utilexec.ExitError
		require.True(t, errors.As(err, &ee), "%v", err)
		_, direct := err.(utilexec.ExitError)
		assert.True(t, direct, "the API server type-asserts, so the error must not be wrapped")
		assert.Equal(t, 3, ee.ExitStatus())
		assert.Equal(t, "err\n", io.stderr.String())
	})
	t.Run("TTYRefused", func(t *testing.T) {
		err := exec(&execIO{tty: true}, "sh")
		require.ErrorIs(t, err, guest.ErrExecTTY)
	})
	t.Run("ProbeTimeoutHonoured", func(t *testing.T) {
		v, err := h.vms.view("default", pod.Name, "")
		require.NoError(t, err)
		start := time.Now()
		ok, msg := probe.ExecCheck(ctx, v.vm, []string{"sleep", "5"}, time.Second)
		assert.False(t, ok)
		assert.Contains(t, msg, "timed out after 1s")
		assert.Less(t, time.Since(start), 4*time.Second)
		ok, msg = probe.ExecCheck(ctx, v.vm, []string{"sh", "-c", "echo not yet; exit 1"}, 10*time.Second)
		assert.False(t, ok)
		assert.Contains(t, msg, "exited with 1: not yet")
	})
	t.Run("NoAgentClearError", func(t *testing.T) {
		err := h.vms.RunInContainer(ctx, "default", off.Name, "vm", []string{"uname", "-m"}, &execIO{})
		require.ErrorIs(t, err, qemu.ErrGuestAgentNotResponding)
		assert.Contains(t, err.Error(), "guest agent not responding on VM")
		assert.Contains(t, err.Error(), "the image runs no qemu-guest-agent")
	})
}
