package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// seaBIOS is a firmware a lease flashes: Debian's SeaBIOS, which boots
// the test image's kernel as QEMU's own does.
const seaBIOS = "/usr/share/seabios/bios-256k.bin"

// TestExporterSetLeaseHygiene runs two leases in sequence on one pod of a
// Jumpstarter-mode set with recyclePolicy Reuse (real control plane,
// controller, node, TCG VMs, the test Jumpstarter): the first lease powers
// the VM off, sets a smaller memory size, flashes the bios and the test
// image's bootable raw disk onto root, powers it on (the VM boots the
// flashed root through the flashed firmware, no -kernel) and writes a
// token in the guest's RAM and one in a file on the flashed root (kubectl
// exec; synced to the disk). With the lease state policy Reset (the
// default) the second lease, on the same pod, sees the set's definition:
// no flashed firmware or root (dump of flashed:bios and flashed:root
// refused: the set's image is a kernel and initrd), the template's memory,
// the set's kernel, initrd and imageID, neither token in the guest (it
// booted again), the set's login, a VM that boots and serves its console
// and HTTP port; the exporter went through AFTER_LEASE_HOOK between them.
// With Keep, the second lease sees what the first left: its firmware,
// memory and root (imageID flash/root@<digest>, a dump of flashed:root
// byte for byte the flashed disk) and both tokens (the guest kept
// running; the file read back from the disk). Both sets have an
// afterLease hook whose exec step writes a file in the guest (through
// qemu-guest-agent, after the reset's boot): the second lease finds it.
func TestExporterSetLeaseHygiene(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane, a node and TCG VMs")
	if _, err := os.Stat(seaBIOS); err != nil {
		t.Skipf("no SeaBIOS to flash (%v): install the seabios package", err)
	}
	e := startExsEnv(t)
	js := e.jumpstarter(t)
	raw := bootableRawDisk(t)
	t.Run("Reset", func(t *testing.T) { e.testLeaseHygiene(t, js, raw, "hyg-reset", v1alpha1.LeaseStatePolicyReset) })
	t.Run("Keep", func(t *testing.T) { e.testLeaseHygiene(t, js, raw, "hyg-keep", v1alpha1.LeaseStatePolicyKeep) })
}

// hygieneRun is what the first lease of testLeaseHygiene left, for the
// second's checks.
type hygieneRun struct {
	pod       corev1.Pod
	defined   qemu.Spec // the VM as the set defines it
	imageID   string    // the set's image as the pod first ran it
	flashed   qemu.Spec // the VM the first lease booted
	digest    string    // the flashed root's
	ramToken  string    // in the first lease's guest's /tmp
	diskToken string    // in a file on the first lease's flashed root
}

// guestRootFAT is a shell function for the test image's guest: root
// mounts the root disk (the first virtio disk without a serial, as the
// image's init finds it) on /mnt/qkroot as FAT, or prints why not and
// fails.
const guestRootFAT = `root() { d=; for b in /sys/block/vd*; do [ -e "$b" ] || continue; ` +
	`[ -n "$(cat "$b/serial" 2>/dev/null)" ] && continue; d=${b##*/}; break; done; ` +
	`[ -n "$d" ] || { echo "no root disk"; return 1; }; mkdir -p /mnt/qkroot; umount /mnt/qkroot 2>/dev/null; ` +
	`mount -t vfat "/dev/$d" /mnt/qkroot 2>/dev/null || { echo "$d holds no FAT"; return 1; }; }; `

// guestTokens prints the guest's RAM token (RAM:<token>) and the token
// file on its root disk, read from the disk (DISK:<token>), or why there
// is none.
const guestTokens = guestRootFAT + `echo "RAM:$(cat /tmp/qk-token 2>&1)"; sync; echo 3 > /proc/sys/vm/drop_caches; ` +
	`if r=$(root); then echo "DISK:$(cat /mnt/qkroot/qktoken 2>&1)"; umount /mnt/qkroot; else echo "DISK:$r"; fi`

func (e *exsEnv) testLeaseHygiene(t *testing.T, js *jsEnv, raw, name string, policy v1alpha1.LeaseStatePolicy) {
	set := e.jsSet(name, 1, 0, js)
	set.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
	set.Spec.Jumpstarter.LeaseStatePolicy = policy
	hookMark := "qk-hook-" + name
	set.Spec.Jumpstarter.Hooks = &v1alpha1.LeaseHooks{AfterLease: &v1alpha1.LeaseHook{
		Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookExec, Command: []string{"/bin/sh", "-c", "echo " + hookMark + " > /tmp/qk-after-lease"}}},
		// the reset's boot under TCG on a loaded machine, then the agent
		Timeout: int32((2 * vmBoot).Seconds()), OnFailure: v1alpha1.LeaseHookEndLease}}
	k := &kubectlEnv{t: t, c: e.c}
	sel := set.Spec.Jumpstarter.ExporterLabels
	e.createSet(t, set)
	defer e.deleteSet(t, name)
	_, pods := e.waitSet(t, name, 2*vmBoot, "one Ready VM with an Online exporter", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		if len(ps) != 1 || !podReady(&ps[0]) {
			return false
		}
		st, ok := js.ctl.ExporterState(e.ns, ps[0].Name)
		return ok && st.Online && st.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
	})
	r := e.hygieneLease1(t, js, k, raw, name+"-1", sel, pods[0])

	// Lease 2 on the same pod (Reuse).
	js.createLease(t, e.ns, name+"-2", sel)
	l2 := js.waitLease(t, e.ns, name+"-2", 2*vmBoot, "Ready", leaseReady)
	require.Equal(t, r.pod.Name, leaseExporter(l2), "Reuse: the same pod")
	st, _ := js.ctl.ExporterState(e.ns, r.pod.Name)
	_, pods = e.waitSet(t, name, 2*vmBoot, "the leased VM Ready", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		return len(ps) == 1 && podReady(&ps[0])
	})
	require.Equal(t, r.pod.UID, pods[0].UID, "Reuse: the same pod")
	assert.True(t, slices.Contains(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK), "the first lease's end ran the hook: %v", st.StatusHistory)
	assert.NotContains(t, st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED, "the hook passed: %s", st.StatusMessage)
	// The afterLease hook's exec step wrote its file in the guest the
	// second lease gets (after the reset's boot with Reset).
	k.eventually(2*vmBoot, hookMark, "-n", e.ns, "exec", r.pod.Name, "--", "cat", "/tmp/qk-after-lease")
	tokens := k.ok("-n", e.ns, "exec", r.pod.Name, "--", "/bin/sh", "-c", guestTokens)
	t.Logf("%s: the second lease's guest: %s", policy, strings.ReplaceAll(strings.TrimSpace(tokens), "\n", "; "))
	if policy == v1alpha1.LeaseStatePolicyKeep {
		e.checkKept(t, js, name+"-2", r, tokens)
	} else {
		e.checkReset(t, js, name+"-2", r, tokens)
	}
	assert.Equal(t, set.Spec.Template.Spec.Containers[0].Image, pods[0].Status.ContainerStatuses[0].Image, "the set's image")
	// The VM serves the second lease: console and guest HTTP, and the
	// set's login (checkGuestLogin).
	e.driveVM(t, js, name+"-2")
	js.release(t, e.ns, name+"-2")
	js.waitLease(t, e.ns, name+"-2", time.Minute, "ended", leaseEnded)
}

// hygieneLease1 is the first lease: with the VM powered off (one boot for
// all the changes: a flash powers a running VM off and on again) a
// smaller memory, a flashed bios and the bootable raw disk raw flashed
// onto root; powered on, the VM boots the flashed root through the
// flashed firmware, and a token goes in the guest's RAM and one in a file
// on the root disk (synced).
func (e *exsEnv) hygieneLease1(t *testing.T, js *jsEnv, k *kubectlEnv, raw, lease string, sel map[string]string, pod corev1.Pod) hygieneRun {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	r := hygieneRun{pod: pod, defined: e.vmSpec(t, pod), imageID: pod.Status.ContainerStatuses[0].ImageID,
		ramToken: "qk-token-" + string(pod.UID), diskToken: "qk-disk-token-" + string(pod.UID)}
	require.Empty(t, r.defined.BIOS, "the set's VM boots QEMU's own firmware")
	require.Equal(t, 256, r.defined.MemoryMiB, "the template's memory limit")
	require.NotEmpty(t, r.defined.Kernel, "the set's image is a kernel and initrd")
	require.NotEmpty(t, r.imageID, "the set's image's imageID")

	js.createLease(t, e.ns, lease, sel)
	l1 := js.waitLease(t, e.ns, lease, time.Minute, "Ready", leaseReady)
	require.Equal(t, pod.Name, leaseExporter(l1))
	sess, err := js.client.Dial(ctx, lease)
	require.NoError(t, err)
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	root, _ := jstest.FindDriver(rep, "")
	flasher, ok := jstest.FindDriver(rep, "flasher")
	require.True(t, ok)
	power, ok := jstest.FindDriver(rep, "power")
	require.True(t, ok)
	_, err = sess.Call(ctx, power.Uuid, "off")
	require.NoError(t, err, "power off")
	_, err = sess.Call(ctx, root.Uuid, "set_memory_size", "192M")
	require.NoError(t, err)
	fw, err := os.Open(seaBIOS)
	require.NoError(t, err)
	require.NoError(t, sess.Flash(ctx, flasher.Uuid, fw, "bios", ""))
	fw.Close()
	sess.Close()
	r.digest = e.flashRoot(t, js, lease, raw) // its own session
	sess, err = js.client.Dial(ctx, lease)
	require.NoError(t, err)
	_, err = sess.Call(ctx, power.Uuid, "on")
	require.NoError(t, err, "power on")
	sess.Close()
	e.waitImageID(t, pod.Name, "flash/root@"+r.digest, 2*time.Minute)
	// The tokens, in the guest the flashed root booted (its guest agent
	// answers once the guest is up).
	write := guestRootFAT + "root && echo " + r.diskToken + " > /mnt/qkroot/qktoken && sync && umount /mnt/qkroot && " +
		"echo " + r.ramToken + " > /tmp/qk-token && echo written " + r.diskToken
	k.eventually(2*vmBoot, "written "+r.diskToken, "-n", e.ns, "exec", pod.Name, "--", "/bin/sh", "-c", write)
	r.flashed = e.vmSpec(t, pod)
	assert.Contains(t, r.flashed.BIOS, "flash", "the first lease boots its flashed bios")
	assert.Equal(t, 192, r.flashed.MemoryMiB)
	assert.Empty(t, r.flashed.Kernel, "the flashed root boots through the firmware, no -kernel")
	js.release(t, e.ns, lease)
	js.waitLease(t, e.ns, lease, time.Minute, "ended", leaseEnded)
	return r
}

// checkKept: under Keep the second lease (lease) sees what the first
// left: its firmware, memory and root, and both tokens in the guest
// (tokens: guestTokens' output).
func (e *exsEnv) checkKept(t *testing.T, js *jsEnv, lease string, r hygieneRun, tokens string) {
	seen := e.vmSpec(t, r.pod)
	assert.Contains(t, tokens, "RAM:"+r.ramToken, "Keep: the first lease's token in the guest's RAM")
	assert.Contains(t, tokens, "DISK:"+r.diskToken, "Keep: the first lease's token file on the root disk")
	assert.Equal(t, r.flashed.BIOS, seen.BIOS, "Keep: the first lease's firmware")
	assert.Equal(t, 192, seen.MemoryMiB, "Keep: the first lease's memory")
	assert.Empty(t, seen.Kernel, "Keep: the first lease's root, booted through the firmware")
	e.waitImageID(t, r.pod.Name, "flash/root@"+r.digest, 30*time.Second)
	sum, err := dumpDigest(t, js, lease, jumpstarter.FlashedPrefix+jumpstarter.PartitionRoot)
	require.NoError(t, err, "Keep: dump of the flashed root")
	assert.Equal(t, r.digest, sum, "Keep: the flashed root is what the first lease flashed, byte for byte")
}

// checkReset: under Reset the second lease (lease) sees the set's
// definition: no flashed firmware or root, the set's memory, kernel,
// initrd and imageID, neither token in the guest (tokens: guestTokens'
// output), and a Reset event.
func (e *exsEnv) checkReset(t *testing.T, js *jsEnv, lease string, r hygieneRun, tokens string) {
	seen := e.vmSpec(t, r.pod)
	assert.NotContains(t, tokens, r.ramToken, "Reset: the guest booted again, without the first lease's token")
	assert.NotContains(t, tokens, r.diskToken, "Reset: no token file on the root disk")
	assert.Regexp(t, `RAM:.*No such file`, tokens, "Reset: no token file in the guest's RAM")
	assert.Empty(t, seen.BIOS, "Reset: the set's firmware, not the flashed bios")
	assert.Equal(t, r.defined.MemoryMiB, seen.MemoryMiB, "Reset: the set's memory")
	assert.Equal(t, r.defined.Kernel, seen.Kernel, "Reset: the set's kernel, not the flashed root")
	assert.Equal(t, r.defined.Initrd, seen.Initrd, "Reset: the set's initrd")
	_, err := dumpDigest(t, js, lease, jumpstarter.FlashedPrefix+jumpstarter.PartitionRoot)
	if assert.Error(t, err, "Reset: no flashed root to dump") {
		assert.Contains(t, err.Error(), "no root disk to dump", "Reset: the set's image is a kernel and initrd")
	}
	_, err = dumpDigest(t, js, lease, jumpstarter.FlashedPrefix+jumpstarter.PartitionBIOS)
	if assert.Error(t, err, "Reset: no flashed bios to dump") {
		assert.Contains(t, err.Error(), "nothing was flashed onto bios")
	}
	e.waitImageID(t, r.pod.Name, r.imageID, 30*time.Second)
	e.waitPodEvent(t, r.pod.Name, "Reset", "reset to the pod's definition", 30*time.Second)
}

// dumpDigest dumps partition part through the lease (flasher dump, no
// compression) and returns the sha256 digest of its bytes.
func dumpDigest(t *testing.T, js *jsEnv, lease, part string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sess, err := js.client.Dial(ctx, lease)
	require.NoError(t, err, "dial lease %s", lease)
	defer sess.Close()
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	flasher, ok := jstest.FindDriver(rep, "flasher")
	require.True(t, ok, "the flasher driver in the report")
	h := sha256.New()
	if err := sess.Dump(ctx, flasher.Uuid, h, part, ""); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// vmSpec is the qemu.Spec the pod's VM was last started with (its
// spec.json in the node's state dir).
func (e *exsEnv) vmSpec(t *testing.T, p corev1.Pod) qemu.Spec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.stateDir, "vms", string(p.UID), "spec.json"))
	require.NoError(t, err)
	var s qemu.Spec
	require.NoError(t, json.Unmarshal(b, &s))
	return s
}
