package provider

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
)

// pipeIO is an api.AttachIO whose output is read while the session runs.
type pipeIO struct {
	in  io.Reader
	out *io.PipeWriter
}

func (p pipeIO) Stdin() io.Reader            { return p.in }
func (p pipeIO) Stdout() io.WriteCloser      { return p.out }
func (p pipeIO) Stderr() io.WriteCloser      { return nopCloser{io.Discard} }
func (p pipeIO) TTY() bool                   { return false }
func (p pipeIO) Resize() <-chan api.TermSize { return nil }

// attachEcho types word into the pod's console through kubectl attach's
// provider side and waits for the test image's echo of it.
func attachEcho(t *testing.T, vms *VMs, pod *corev1.Pod, word string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- vms.AttachToContainer(ctx, pod.Namespace, pod.Name, "vm", pipeIO{in: inR, out: outW})
		outW.Close()
	}()
	go func() {
		for ctx.Err() == nil {
			_, _ = io.WriteString(inW, word+"\n")
			time.Sleep(2 * time.Second)
		}
	}()
	r := bufio.NewReader(outR)
	for {
		line, err := r.ReadString('\n')
		if strings.Contains(line, "QK-ECHO: "+word) {
			break
		}
		if err != nil {
			t.Fatalf("attach to %s: no echo of %q: %v (attach: %v)", pod.Name, word, err, <-done)
		}
	}
	cancel()
	inW.Close()
	go io.Copy(io.Discard, outR)
	<-done
}

// vmUserDirs does for uid 107 what the agent does at start
// (cmd/qemu-kubelet vmUserSearch): the state dir and its vms dir are
// searchable by gid 107.
func vmUserDirs(t testing.TB, stateDir string) {
	t.Helper()
	for _, d := range []string{stateDir, filepath.Join(stateDir, VMsDirName)} {
		require.NoError(t, os.MkdirAll(d, 0o710))
		require.NoError(t, os.Chmod(d, 0o710))
		require.NoError(t, os.Lchown(d, 0, 107))
	}
}

// qemuIDs returns QEMU's real and effective uid and gid (/proc/<pid>/status).
func qemuIDs(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	var ids []string
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 3 && (f[0] == "Uid:" || f[0] == "Gid:") {
			ids = append(ids, f[0]+f[1]+"/"+f[2])
		}
	}
	return strings.Join(ids, " ")
}

// TestVMUserAdoptAcrossRestart: an agent upgraded to run QEMU as a vmUser
// adopts the VM an older agent started as root as it runs (same QEMU, still
// root) and starts new VMs as the vmUser whatever the pod asks for
// (securityContext runAsUser 0 is not read); both are adopted again by the
// next agent and serve their consoles through kubectl attach's provider
// side; the root VM's next start (a crash, restart policy Always) runs as
// the vmUser in the directory the old agent made.
func TestVMUserAdoptAcrossRestart(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU and a registry")
	if os.Geteuid() != 0 {
		t.Skip("needs root to start QEMU as another user")
	}
	env := newVMEnv(t)
	testutil.Searchable(t, env.root)
	vmUserDirs(t, env.stateDir)
	ctx := context.Background()
	user := &qemu.User{UID: 107, GID: 107}
	withUser := func(c *VMsConfig) { c.VMUser = user }

	// The old agent: QEMU as root.
	old := newHarness(t, env.stateDir, env.store, env.imageDir)
	rootPod := podFor("u-root", env.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	require.NoError(t, old.vms.CreatePod(ctx, rootPod))
	old.wait(rootPod.UID, 90*time.Second, "Running", running)
	rootDir := filepath.Join(env.stateDir, VMsDirName, string(rootPod.UID))
	waitConsole(t, rootDir, vmtest.BootMarker, 60*time.Second)
	rootPid := vmtest.QEMUPids(rootDir)
	require.Len(t, rootPid, 1)
	require.Equal(t, "Uid:0/0 Gid:0/0", qemuIDs(t, rootPid[0]))

	// The upgraded agent adopts it as it runs.
	old.cancel()
	time.Sleep(200 * time.Millisecond)
	h := newHarnessWith(t, env.stateDir, env.store, env.imageDir, withUser)
	res, err := h.vms.Recover(ctx)
	require.NoError(t, err)
	assert.Equal(t, RecoveryResult{Running: 1}, res)
	assert.Equal(t, rootPid, vmtest.QEMUPids(rootDir), "same QEMU")
	assert.Equal(t, "Uid:0/0 Gid:0/0", qemuIDs(t, rootPid[0]), "adopted as it runs")

	// A new pod asking for root gets the node's user.
	zero := int64(0)
	userPod := podFor("u-user", env.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	userPod.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: &zero, RunAsGroup: &zero}
	userPod.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{RunAsUser: &zero, RunAsGroup: &zero}
	require.NoError(t, h.vms.CreatePod(ctx, userPod))
	h.wait(userPod.UID, 90*time.Second, "Running", running)
	userDir := filepath.Join(env.stateDir, VMsDirName, string(userPod.UID))
	waitConsole(t, userDir, vmtest.BootMarker, 60*time.Second)
	userPid := vmtest.QEMUPids(userDir)
	require.Len(t, userPid, 1)
	require.Equal(t, "Uid:107/107 Gid:107/107", qemuIDs(t, userPid[0]))
	for _, f := range []string{PodFileName, StatusFileName, qemu.SpecFileName} {
		fi, err := os.Stat(filepath.Join(userDir, f))
		require.NoError(t, err)
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: owner %d mode %v: the agent's record must stay the agent's alone", f, st.Uid, fi.Mode().Perm())
		}
	}

	// The next agent adopts both; their consoles answer.
	h.cancel()
	time.Sleep(200 * time.Millisecond)
	h2 := newHarnessWith(t, env.stateDir, env.store, env.imageDir, withUser)
	res, err = h2.vms.Recover(ctx)
	require.NoError(t, err)
	assert.Equal(t, RecoveryResult{Running: 2}, res)
	assert.Equal(t, rootPid, vmtest.QEMUPids(rootDir))
	assert.Equal(t, userPid, vmtest.QEMUPids(userDir))
	for _, p := range []*corev1.Pod{rootPod, userPod} {
		got, err := h2.vms.GetPod(ctx, p.Namespace, p.Name)
		require.NoError(t, err)
		assert.True(t, running(got), "%s Running after adoption: %+v", p.Name, got.Status.ContainerStatuses)
		attachEcho(t, h2.vms, p, "adopted-"+string(p.UID))
	}

	// The root VM crashes: its next start runs as the vmUser.
	require.NoError(t, syscall.Kill(rootPid[0], syscall.SIGKILL))
	h2.wait(rootPod.UID, 90*time.Second, "restarted", func(p *corev1.Pod) bool {
		return running(p) && p.Status.ContainerStatuses[0].RestartCount == 1
	})
	waitConsole(t, rootDir, vmtest.BootMarker, 60*time.Second)
	newPid := vmtest.QEMUPids(rootDir)
	require.Len(t, newPid, 1)
	assert.Equal(t, "Uid:107/107 Gid:107/107", qemuIDs(t, newPid[0]), "the restarted VM runs as the vmUser")
	attachEcho(t, h2.vms, rootPod, "restarted-as-107")

	for _, p := range []*corev1.Pod{rootPod, userPod} {
		require.NoError(t, h2.vms.DeletePod(ctx, deleting(p)))
	}
	waitGoneDir(t, rootDir, 60*time.Second)
	waitGoneDir(t, userDir, 60*time.Second)
}
