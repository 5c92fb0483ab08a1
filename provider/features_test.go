package provider

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// TestHeldPodStartsWhenEnabled: a UEFI pod on a node with uefi disabled
// waits (Pending, FeatureDisabled with the message, a warning event), stays
// held across an agent restart (recovery), does not start on a reload that
// leaves uefi off, and leaves the hold on the reload that enables it (its
// image pull then fails: no registry, so no QEMU is needed). A second held
// pod deleted while held goes away.
func TestHeldPodStartsWhenEnabled(t *testing.T) {
	root := t.TempDir()
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	stateDir := filepath.Join(root, "state")
	off := podtest.FeaturesWith(config.FeatureUEFI)
	mutate := func(c *VMsConfig) {
		c.UEFICode, c.UEFIVars = "/nonexistent/OVMF_CODE.fd", "/nonexistent/OVMF_VARS.fd"
		c.Features = off
	}
	h := newHarnessWith(t, stateDir, store, imageDir, mutate)
	ctx := context.Background()
	uefiAnn := map[string]string{podspec.AnnotationFirmware: "uefi"}
	pod := podFor("held", "127.0.0.1:1/none/img:v1", corev1.RestartPolicyAlways, uefiAnn)
	gone := podFor("held-gone", "127.0.0.1:1/none/img:v1", corev1.RestartPolicyAlways, uefiAnn)
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	require.NoError(t, h.vms.CreatePod(ctx, gone))
	heldFor := func(p *corev1.Pod) bool {
		w := lastState(p)
		cs, ok := w.(corev1.ContainerStatus)
		return ok && p.Status.Phase == corev1.PodPending && cs.State.Waiting != nil && cs.State.Waiting.Reason == ReasonFeatureDisabled
	}
	p := h.wait(pod.UID, 10*time.Second, "held", heldFor)
	msg := p.Status.ContainerStatuses[0].State.Waiting.Message
	assert.Contains(t, msg, "features.uefi: false")
	h.wait(gone.UID, 10*time.Second, "held", heldFor)
	events := strings.Join(h.drainEvents(), "\n")
	assert.Contains(t, events, "Warning FeatureDisabled pod needs uefi")

	// Deleted while held: terminated and forgotten, never started.
	require.NoError(t, h.vms.DeletePod(ctx, deleting(gone)))
	waitGoneDir(t, filepath.Join(stateDir, VMsDirName, string(gone.UID)), 10*time.Second)

	// The agent restarts (same state dir, uefi still off): still held.
	h.cancel()
	h2 := newHarnessWith(t, stateDir, store, imageDir, mutate)
	res, err := h2.vms.Recover(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, res.Pending)
	_, err = h2.vms.GetPod(ctx, pod.Namespace, pod.Name) // the API server still has it
	require.NoError(t, err)
	h2.wait(pod.UID, 10*time.Second, "held after restart", heldFor)

	// A reload that changes something else leaves it held.
	other := podtest.FeaturesWith(config.FeatureUEFI, config.FeatureAttach)
	h2.vms.SetFeatures(other)
	time.Sleep(300 * time.Millisecond)
	h2.wait(pod.UID, time.Second, "still held", heldFor)
	assert.Same(t, other, h2.vms.Features())

	// uefi enabled: the pod leaves the hold and starts (the pull fails).
	h2.vms.SetFeatures(config.DefaultFeatures())
	h2.wait(pod.UID, 30*time.Second, "pull attempted", func(p *corev1.Pod) bool {
		cs, ok := lastState(p).(corev1.ContainerStatus)
		return ok && cs.State.Waiting != nil && (cs.State.Waiting.Reason == podstatus.ReasonErrImagePull || cs.State.Waiting.Reason == podstatus.ReasonImagePullBackOff)
	})
	// Left the hold: the status after the last FeatureDisabled is the start's
	// ContainerCreating, or the failed pull itself when the status pump
	// coalesced the two (it delivers the latest push: podstatus/statuspump.go).
	tags := h2.seenTags(pod.UID)
	held := slices.Index(tags, "Pending/"+ReasonFeatureDisabled)
	require.NotEqual(t, -1, held, "held before the reload: %v", tags)
	for held+1 < len(tags) && tags[held+1] == "Pending/"+ReasonFeatureDisabled {
		held++
	}
	require.Less(t, held+1, len(tags), "left the hold: %v", tags)
	assert.Contains(t, []string{"Pending/" + podstatus.ReasonContainerCreating, "Pending/" + podstatus.ReasonErrImagePull},
		tags[held+1], "left the hold: %v", tags)
	assert.Contains(t, strings.Join(h2.drainEvents(), "\n"), "Normal FeatureEnabled feature(s) uefi enabled on node n1")
	require.NoError(t, h2.vms.DeletePod(ctx, deleting(pod)))
	waitGoneDir(t, filepath.Join(stateDir, VMsDirName, string(pod.UID)), 10*time.Second)
}

// TestVMSpecConsoleLogSize: features.consoleLogSize reaches the spec of VMs
// started after it is set; the default is qemu's own cap (today's).
func TestVMSpecConsoleLogSize(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: "tcg"})
	rec := &podVM{uid: "uid-c", dir: p.podDir("uid-c")}
	img := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz")}
	pod := podtest.VMPod()
	plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
	require.Nil(t, rej)
	spec, err := vmSpec(vmRun{name: vmName(pod), dir: rec.dir, plan: plan}, img, p.nodeVMSettings())
	require.NoError(t, err)
	assert.Equal(t, qemu.DefaultConsoleCap, spec.ConsoleCapBytes)

	f := config.DefaultFeatures()
	f.ConsoleLogSize = config.MinConsoleLogSize
	p.SetFeatures(f)
	spec, err = vmSpec(vmRun{name: vmName(pod), dir: rec.dir, plan: plan}, img, p.nodeVMSettings())
	require.NoError(t, err)
	assert.Equal(t, int64(config.MinConsoleLogSize), spec.ConsoleCapBytes)
	spec.Disks = nil
	assert.NoError(t, spec.Validate(), "the smallest size the config accepts is one qemu accepts")
}
