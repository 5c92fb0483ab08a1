package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// stateBoot is one "QK-STATE <token> <boots>" line of a guest booted with
// vmtest.StateCmdline: the record its disk held at that boot.
type stateBoot struct {
	Token string
	N     int
}

// stateBoots reads the boot records of a console log (missing file: none).
func stateBoots(path string) []stateBoot {
	b, _ := os.ReadFile(path)
	var out []stateBoot
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, "QK-STATE ")
		if i < 0 {
			continue
		}
		f := strings.Fields(line[i+len("QK-STATE "):])
		if len(f) != 2 {
			continue
		}
		n, err := strconv.Atoi(f[1])
		if err != nil {
			continue
		}
		out = append(out, stateBoot{f[0], n})
	}
	return out
}

// testStatePolicy: the guest writes a record (a random token it makes and
// a boot count) on its disk at every boot, reboots itself once, then powers
// itself off once (a new VM start under restartPolicy Always).
//   - Retain: one token through the guest reboot, the VM restart, and a VM
//     crash while the node agent was down (boots 1 to 4, one disk);
//   - Disabled: the guest reboot keeps the disk (same QEMU process, same
//     overlay), but every VM start begins from a fresh one: a new token,
//     boot 1 again;
//   - deleting the Retain pod (reclaim policy Retain) keeps a standalone
//     copy of its disk under <stateDir>/retained with the guest's last
//     record, which the node counts against its allocatable
//     ephemeral-storage until it is removed; the Disabled pod leaves
//     nothing.
func (e *podEnv) testStatePolicy(t *testing.T) {
	ctx := context.Background()
	img := vmtest.PushStateImage(t, e.reg, "state", vmtest.VariantACPI)
	retain := e.create(t, vmPodSpec("state-retain", e.a.name, img, corev1.RestartPolicyAlways, map[string]string{
		podspec.AnnotationKernelCmdline:  vmtest.StateCmdline,
		v1alpha1.StatePolicyAnnotation:   string(v1alpha1.StatePolicyRetain),
		v1alpha1.ReclaimPolicyAnnotation: string(v1alpha1.ReclaimPolicyRetain),
	}))
	fresh := e.create(t, vmPodSpec("state-fresh", e.a.name, img, corev1.RestartPolicyAlways, map[string]string{
		podspec.AnnotationKernelCmdline: vmtest.StateCmdline,
	}))
	rdir, fdir := e.a.vmDir(string(retain.UID)), e.a.vmDir(string(fresh.UID))
	cur := func(dir string) []stateBoot { return stateBoots(filepath.Join(dir, qemu.ConsoleLogName)) }
	prev := func(dir string) []stateBoot { return stateBoots(filepath.Join(dir, qemu.ConsolePreviousLogName)) }
	waitBoots := func(what string, timeout time.Duration, ok func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(context.Context) (bool, error) { return ok(), nil }); err != nil {
			b, _ := os.ReadFile(filepath.Join(rdir, qemu.ConsoleLogName))
			f, _ := os.ReadFile(filepath.Join(fdir, qemu.ConsoleLogName))
			t.Fatalf("%s: %v\nretain: previous %v current %v\n%s\nfresh: previous %v current %v\n%s", what, err,
				prev(rdir), cur(rdir), tail(string(b), 15), prev(fdir), cur(fdir), tail(string(f), 15))
		}
	}

	// Retain: boots 1 and 2 in the first VM run (a guest reboot between),
	// boot 3 in the second, one token.
	waitBoots("the Retain pod's third boot", 5*time.Minute, func() bool { return len(cur(rdir)) == 1 && cur(rdir)[0].N == 3 })
	first := prev(rdir)
	require.Len(t, first, 2, "first VM run: a boot and a guest reboot")
	tok := first[0].Token
	assert.Equal(t, []stateBoot{{tok, 1}, {tok, 2}}, first, "the guest reboot kept the disk")
	assert.Equal(t, []stateBoot{{tok, 3}}, cur(rdir), "the VM restart kept the disk: the guest's record written in the first run is there")
	p := waitPod(t, e.c, "default", retain.Name, 30*time.Second, "Running after one restart", func(p *corev1.Pod) bool {
		return podRunning(p) && p.Status.ContainerStatuses[0].RestartCount == 1
	})
	assert.Equal(t, int32(1), p.Status.ContainerStatuses[0].RestartCount)
	waitEvent(t, e.c, retain.Name, poddisk.ReasonStateRestored, "state policy Retain") // features_test.go

	// Disabled: the same two boots per run, but each run from a fresh disk.
	waitBoots("the Disabled pod's second VM run", 5*time.Minute, func() bool { return len(prev(fdir)) == 2 && len(cur(fdir)) >= 1 })
	fp, fc := prev(fdir), cur(fdir)
	assert.Equal(t, []stateBoot{{fp[0].Token, 1}, {fp[0].Token, 2}}, fp, "a guest reboot is no VM start: the disk stays")
	assert.Equal(t, 1, fc[0].N, "a VM start under Disabled begins from a fresh disk: boot 1 again")
	assert.NotEqual(t, fp[0].Token, fc[0].Token, "a fresh disk: the guest made a new token")
	assert.NotEqual(t, tok, fc[0].Token)

	// The node agent dies; the Retain pod's VM crashes while it is down;
	// the agent comes back, finds the exit, restarts the VM: same disk.
	pids := vmtest.QEMUPids(rdir)
	require.Len(t, pids, 1)
	_ = e.a.kill(syscall.SIGKILL) // the exit error is the signal
	require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
	require.Eventually(t, func() bool { return len(vmtest.QEMUPids(rdir)) == 0 }, 30*time.Second, 100*time.Millisecond)
	e.a.start()
	waitNode(t, e.c, e.a.name, 90*time.Second, "Ready=True after the restart", readyIs(corev1.ConditionTrue))
	waitBoots("the Retain pod's fourth boot, after an agent restart and a VM crash", 4*time.Minute, func() bool {
		c := cur(rdir)
		return len(c) == 1 && c[0].N == 4
	})
	assert.Equal(t, []stateBoot{{tok, 4}}, cur(rdir), "the crash and the agent restart kept the disk")

	// Delete both. The Retain pod's disk is kept, standalone, with its
	// record; the node's allocatable ephemeral-storage shrinks by its size.
	stateDir := filepath.Join(e.a.dir, "state")
	node, err := e.c.Client().CoreV1().Nodes().Get(ctx, e.a.name, metav1.GetOptions{})
	require.NoError(t, err)
	alloc0 := node.Status.Allocatable[corev1.ResourceEphemeralStorage]
	for _, p := range []*corev1.Pod{retain, fresh} {
		require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, p.Name, metav1.DeleteOptions{}))
	}
	for _, p := range []*corev1.Pod{retain, fresh} {
		waitPodGone(t, e.c, "default", p.Name, 90*time.Second)
		waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
	}
	kept := filepath.Join(stateDir, nodestatus.RetainedDirName, "default_state-retain_"+string(retain.UID))
	b, err := os.ReadFile(filepath.Join(kept, poddisk.RetainedFileName))
	require.NoError(t, err, "the retained disk's record")
	var rd poddisk.RetainedDisk
	require.NoError(t, json.Unmarshal(b, &rd))
	assert.Equal(t, retain.UID, rd.UID)
	assert.Equal(t, "state-retain", rd.Name)
	assert.Equal(t, "Retain", rd.StatePolicy)
	assert.Contains(t, rd.ImageDigest, "sha256:")
	info, err := qemu.InspectImage(ctx, filepath.Join(kept, poddisk.OverlayFileName))
	require.NoError(t, err)
	assert.Empty(t, info.BackingFile, "the kept disk needs no image")
	raw := filepath.Join(t.TempDir(), "kept.raw")
	out, err := exec.Command("qemu-img", "convert", "-O", "raw", filepath.Join(kept, poddisk.OverlayFileName), raw).CombinedOutput()
	require.NoError(t, err, "%s", out)
	disk, err := os.ReadFile(raw)
	require.NoError(t, err)
	require.Greater(t, len(disk), 1<<20+64)
	assert.Equal(t, "QKSTATE "+tok+" 4\n", string(bytes.TrimRight(disk[1<<20:1<<20+64], "\x00")), "the kept disk holds the guest's last record")
	ents, err := os.ReadDir(filepath.Join(stateDir, nodestatus.RetainedDirName))
	require.NoError(t, err)
	assert.Len(t, ents, 1, "the Disabled pod (reclaim policy Delete) left nothing")

	retained, err := nodestatus.RetainedBytes(stateDir)
	require.NoError(t, err)
	require.Positive(t, retained)
	want := alloc0.DeepCopy()
	want.Sub(*resource.NewQuantity(retained, resource.BinarySI))
	waitNode(t, e.c, e.a.name, 30*time.Second, "allocatable ephemeral-storage less the retained disk", func(n *corev1.Node) bool {
		a := n.Status.Allocatable[corev1.ResourceEphemeralStorage]
		return a.Cmp(want) == 0
	})
	// Cleanup, as docs/pods.md says: remove the directory.
	require.NoError(t, os.RemoveAll(kept))
	waitNode(t, e.c, e.a.name, 30*time.Second, "allocatable ephemeral-storage back", func(n *corev1.Node) bool {
		a := n.Status.Allocatable[corev1.ResourceEphemeralStorage]
		return a.Cmp(alloc0) == 0
	})
}
