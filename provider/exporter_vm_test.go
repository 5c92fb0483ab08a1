package provider

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/emptypb"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// TestJumpstarterExporterVM: a VM pod served as a Jumpstarter exporter by
// the provider, on real QEMU (TCG), the test registry, and jstest's
// controller and router (TLS) driven by jstest's Go client through the
// router as jmp does: report, console both ways, TCP to the guest's HTTP
// port, power off (at once: QEMU quits, the guest never sees the ACPI
// button), shutdown (the guest sees the button) and on, flash another
// image and see it boot, flash a local xz disk image onto root through
// the router (a resource stream) and see it boot through the firmware,
// dump it back byte for byte, bad flash and unknown method errors, a wrong
// token on a second pod (condition and event, the VM keeps running), an
// agent restart (the re-adopted VM's exporter comes back Online and the
// flashed image stays), delete (unregisters).
func TestJumpstarterExporterVM(t *testing.T) {
	if testing.Short() {
		t.Skip("boots VMs under QEMU")
	}
	root := testutil.Searchable(t, t.TempDir())
	vmtest.ReapQEMU(t, root)
	// The agent's log, kept to check that no password reaches it.
	agentLog := &syncBuffer{}
	klog.LogToStderr(false)
	klog.SetOutput(io.MultiWriter(os.Stderr, agentLog))
	t.Cleanup(func() { klog.SetOutput(os.Stderr); klog.LogToStderr(true) })
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	flashRef := vmtest.PushVariant(t, reg.Addr, "flash-me", vmtest.VariantNoACPI, "qk.flashed=1")
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	stateDir := filepath.Join(root, "state")

	ctrl, err := jstest.Start(jstest.Options{DialWait: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(ctrl.Close)
	const ns = "lab"
	token := ctrl.AddExporter(ns, "board-0", "")
	ctrl.AddExporter(ns, "board-bad", "")
	secrets := &secretStore{m: map[string]*corev1.Secret{}}
	const guestPassword, registryPassword = "Guest-Pa55-9f2c", "Registry-Pa55-77ab"
	secretFor := func(name, exporter, tok string) *corev1.Secret {
		s := podtest.ExporterSecret("endpoint", ctrl.Endpoint(), "token", tok, "namespace", ns, "name", exporter, "ca.crt", string(ctrl.CABundle()),
			"username", "ci", "password", guestPassword)
		s.Namespace, s.Name = "default", name
		return s
	}
	events := &eventLog{}
	metrics, err := telemetry.NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	// QEMU as an agent running as root runs it by default (vmUser 107):
	// consoles, display, guest agent, flashed firmware and disks reach it.
	vmUserDirs(t, stateDir)
	vmUserDirs(t, filepath.Join(root, "state-backoff"))
	cfg := func(c *VMsConfig) {
		c.Secrets = secrets.get
		c.Exporters = realExporters
		c.Recorder = events
		c.Telemetry = telemetry.NewTelemetry(metrics, nil)
		c.VMUser = &qemu.User{UID: 107, GID: 107}
	}
	h := newHarnessWith(t, stateDir, store, imageDir, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()

	grace := int64(6)
	mkPod := func(uid, secret string) *corev1.Pod {
		p := podFor(uid, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: secret}) // no display annotation: the vnc child by default
		p.Labels = map[string]string{"jumpstarter.dev/board": "qemu-test", "app": "x"}
		// A request and no limit: the VM may be resized up to what the node has.
		p.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: podtest.RL("cpu", "1", "memory", "256Mi")}
		p.Spec.TerminationGracePeriodSeconds = &grace
		p.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}, {Name: "ssh", ContainerPort: 22}, {Name: "telnet", ContainerPort: 23}}
		return p
	}
	pod := mkPod("u-js", "js")
	dir := filepath.Join(stateDir, VMsDirName, "u-js")
	bad := mkPod("u-bad", "js-bad")
	badDir := filepath.Join(stateDir, VMsDirName, "u-bad")

	// The Secret does not exist yet: the VM waits in CreateContainerConfigError.
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	p := h.wait(pod.UID, 60*time.Second, "CreateContainerConfigError", func(p *corev1.Pod) bool {
		return waitingReason(p) == podspec.ReasonCreateContainerConfigError
	})
	assert.Contains(t, p.Status.ContainerStatuses[0].State.Waiting.Message, `secret "js" not found`)
	assert.Empty(t, vmtest.QEMUPids(dir), "no VM without its exporter secret")
	secrets.put(secretFor("js", "board-0", token))
	secrets.put(secretFor("js-bad", "board-bad", "not-the-token"))
	require.NoError(t, h.vms.CreatePod(ctx, bad))

	h.wait(pod.UID, 90*time.Second, "Running", running)
	waitConsole(t, dir, vmtest.BootMarker, 90*time.Second)
	st, err := ctrl.WaitExporter(ctx, ns, "board-0", func(s jstest.ExporterState) bool {
		return s.Registered && s.Online && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
	})
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu-test", "jumpstarter.dev/name": "board-0"}, st.Labels, "the pod's jumpstarter.dev/ labels and the exporter's name, as upstream's exporter registers")
	h.wait(pod.UID, 10*time.Second, "exporter Online", condReason("Online"))

	require.NoError(t, ctrl.AssignLease(ns, "lease-1", "board-0", "alice"))
	h.wait(pod.UID, 20*time.Second, "exporter Leased", condReason("Leased"))
	cl := ctrl.NewClient(ns, "alice")
	s, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	uuidOf := func(n string) string {
		d, ok := jstest.FindDriver(rep, n)
		require.True(t, ok, "driver %q in the report", n)
		return d.GetUuid()
	}
	pd, _ := jstest.FindDriver(rep, "power")
	assert.Equal(t, "jumpstarter_driver_power.client.PowerClient", pd.GetLabels()["jumpstarter.dev/client"])
	v, err := s.Call(ctx, uuidOf(""), "get_hostname")
	require.NoError(t, err)
	assert.Equal(t, "vm-u-js", v)

	t.Run("Console", func(t *testing.T) {
		con, err := s.Stream(ctx, uuidOf("console"), "connect")
		require.NoError(t, err)
		defer con.Close()
		_, err = con.Write([]byte("hello-jumpstarter\n"))
		require.NoError(t, err)
		testutil.ReadUntil(t, con, "QK-ECHO: hello-jumpstarter", 30*time.Second)
		pids := vmtest.QEMUPids(dir)
		require.Len(t, pids, 1)
		assert.Equal(t, "Uid:107/107 Gid:107/107", qemuIDs(t, pids[0]), "QEMU runs as the node's vmUser")
	})

	t.Run("GuestTCP", func(t *testing.T) {
		c, err := s.Stream(ctx, uuidOf("http"), "connect")
		require.NoError(t, err)
		_, err = c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
		require.NoError(t, err)
		testutil.ReadUntil(t, bufio.NewReader(c), "QK-HTTP-OK", 30*time.Second)
		c.Close()
		c, err = s.Stream(ctx, uuidOf("ssh"), "connect")
		require.NoError(t, err, "the test image's sshd listens on 22")
		testutil.ReadUntil(t, bufio.NewReader(c), "SSH-2.0-", 30*time.Second)
		c.Close()
		_, err = s.Stream(ctx, uuidOf("telnet"), "connect")
		require.Error(t, err, "nothing listens on 23 in the test image")
		assert.Contains(t, err.Error(), "connection refused by the guest")
	})

	t.Run("UnknownMethodKeepsServing", func(t *testing.T) {
		_, err := s.Call(ctx, uuidOf("power"), "explode")
		require.Error(t, err)
		_, err = s.Call(ctx, "00000000-0000-4000-8000-000000000000", "on")
		require.Error(t, err)
		v, err := s.Call(ctx, uuidOf(""), "get_hostname")
		require.NoError(t, err, "the exporter keeps serving")
		assert.Equal(t, "vm-u-js", v)
	})

	pidsBefore := vmtest.QEMUPids(dir)
	require.Len(t, pidsBefore, 1)
	t.Run("PowerOffAndOn", func(t *testing.T) {
		// `j power off` is at once, as upstream's QEMU driver: QEMU is told
		// to quit, the guest never sees the ACPI power button.
		_, err := s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err)
		p := h.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		assert.Equal(t, corev1.PodRunning, p.Status.Phase, "a powered-off pod stays Running")
		cs := p.Status.ContainerStatuses[0]
		assert.False(t, cs.Ready)
		assert.Equal(t, int32(0), cs.RestartCount)
		require.NotNil(t, cs.LastTerminationState.Terminated)
		term := cs.LastTerminationState.Terminated
		assert.Equal(t, int32(qemu.ExitCodeKilled), term.ExitCode, "QEMU was stopped, the guest did not power off")
		assert.Contains(t, term.Message, "at once")
		assert.NotContains(t, term.Message, "ACPI")
		require.NotNil(t, cs.State.Waiting)
		assert.NotContains(t, cs.State.Waiting.Message, "ACPI")
		assert.Contains(t, events.all(), "Normal PoweringOff Powering off the VM on request at once (quit, kill after 5s)")
		assert.Empty(t, vmtest.QEMUPids(dir))
		cons, err := os.ReadFile(filepath.Join(dir, qemu.ConsoleLogName))
		require.NoError(t, err)
		assert.Contains(t, string(cons), vmtest.BootMarker, "the console of the run that was stopped")
		assert.NotContains(t, string(cons), "QK-ACPI-POWERDOWN", "power off at once does not press the ACPI button")
		assert.True(t, vmStateFile(t, dir).PoweredOff)
		// The restart policy (Always) does not bring it back.
		time.Sleep(3 * time.Second)
		assert.Empty(t, vmtest.QEMUPids(dir))
		assert.NotContains(t, h.seenTags(pod.UID), "Running/CrashLoopBackOff")
		_, err = s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err, "off when off: nothing to do")
		_, err = s.Call(ctx, uuidOf("power"), "shutdown")
		require.NoError(t, err, "shutdown when off: nothing to do")
		_, err = s.Stream(ctx, uuidOf("console"), "connect")
		require.Error(t, err, "no console while off")

		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		p = h.wait(pod.UID, 10*time.Second, "Running again", running)
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount, "a power cycle is no restart")
		waitConsole(t, dir, vmtest.BootMarker, 90*time.Second)
		assert.False(t, vmStateFile(t, dir).PoweredOff)

		// `shutdown` (power.call("shutdown")) is the graceful one: the
		// guest powers off on the ACPI button.
		_, err = s.Call(ctx, uuidOf("power"), "shutdown")
		require.NoError(t, err)
		p = h.wait(pod.UID, 5*time.Second, "PoweredOff by shutdown", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		cs = p.Status.ContainerStatuses[0]
		require.NotNil(t, cs.LastTerminationState.Terminated)
		assert.Equal(t, int32(0), cs.LastTerminationState.Terminated.ExitCode, "the guest powered off on the ACPI button")
		waitConsole(t, dir, "QK-ACPI-POWERDOWN", 5*time.Second)
		assert.Empty(t, vmtest.QEMUPids(dir))
		assert.True(t, vmStateFile(t, dir).PoweredOff)

		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		p = h.wait(pod.UID, 10*time.Second, "Running again after shutdown", running)
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount, "a power cycle is no restart")
		waitConsole(t, dir, vmtest.BootMarker, 90*time.Second)
		prev, err := os.ReadFile(filepath.Join(dir, qemu.ConsolePreviousLogName))
		require.NoError(t, err)
		assert.Contains(t, string(prev), "QK-ACPI-POWERDOWN", "the previous run's console ends with the power button")
		assert.False(t, vmStateFile(t, dir).PoweredOff)
	})

	t.Run("GuestLogin", func(t *testing.T) {
		// get_username/get_password answer the Secret's login, which the
		// guest gets as vendor-data of its NoCloud seed.
		for m, want := range map[string]string{"get_username": "ci", "get_password": guestPassword} {
			v, err := s.Call(ctx, uuidOf(""), m)
			require.NoError(t, err)
			assert.Equal(t, want, v, m)
		}
		seed := filepath.Join(dir, podspec.VolumesDirName, podspec.CloudInitVolumeName+".img")
		vd := ocitest.Run(ctx, t, "", "mtype", "-i", seed, "::vendor-data")
		assert.Contains(t, vd, "#cloud-config")
		assert.Contains(t, vd, guestPassword)
		assert.Contains(t, vd, "ssh_pwauth: true")
	})

	t.Run("Display", func(t *testing.T) {
		vnc, ok := jstest.FindDriver(rep, "vnc")
		require.True(t, ok, "an exporter pod with no display annotation has the vnc child by default")
		assert.Equal(t, jumpstarter.ClassNetwork, vnc.GetLabels()[jumpstarter.LabelClient])
		c, err := s.Stream(ctx, vnc.GetUuid(), "connect")
		require.NoError(t, err)
		defer c.Close()
		greet := make([]byte, 12)
		_, err = io.ReadFull(c, greet)
		require.NoError(t, err)
		assert.Equal(t, "RFB 003.008\n", string(greet), "QEMU's VNC server through the router")
	})

	// guestMemTotal is the guest's MemTotal, through its guest agent.
	guestMemTotal := func(t *testing.T, vms *VMs) int64 {
		var io execIO
		require.NoError(t, vms.RunInContainer(ctx, "default", pod.Name, "vm", []string{"sh", "-c", "grep MemTotal /proc/meminfo"}, &io))
		var kb int64
		_, err := fmt.Sscanf(strings.TrimSpace(io.stdout.String()), "MemTotal: %d kB", &kb)
		require.NoError(t, err, "%q", io.stdout.String())
		return kb << 10
	}
	var resizedMemTotal int64
	t.Run("ResizeMemory", func(t *testing.T) {
		logs, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
		require.NoError(t, err)
		memTotal := func() int64 { return guestMemTotal(t, h.vms) }
		waitConsole(t, dir, "QK-AGENT-OK", 90*time.Second)
		before := memTotal()
		root := uuidOf("")
		// Refused at the call: more than the node has, a disk the VM lacks,
		// a size that does not parse.
		_, err = s.Call(ctx, root, "set_memory_size", "1T")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "the node cannot give it")
		_, err = s.Call(ctx, root, "set_disk_size", "1G")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "the VM has no disk")
		_, err = s.Call(ctx, root, "set_memory_size", "lots")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "Invalid size: 'lots'")
		assert.Nil(t, vmStateFile(t, dir).Size, "refused sizes are not recorded")

		_, err = s.Call(ctx, root, "set_memory_size", "400M")
		require.NoError(t, err)
		assert.Equal(t, int64(400<<20), vmStateFile(t, dir).Size.MemoryBytes, "recorded before the call returned")
		p := h.wait(pod.UID, 5*time.Second, "VMResized pending", func(p *corev1.Pod) bool {
			c := podCond(p, podstatus.ConditionVMResized)
			return c != nil && c.Reason == podstatus.ReasonResizePendingPowerOn
		})
		assert.Equal(t, "memory 400Mi from the next power on (set through the Jumpstarter exporter)", podCond(p, podstatus.ConditionVMResized).Message)
		assert.InDelta(t, float64(before), float64(memTotal()), float64(8<<20), "the running VM keeps its memory")

		_, err = s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err)
		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		h.wait(pod.UID, 10*time.Second, "Running", running)
		waitConsole(t, dir, "QK-AGENT-OK", 90*time.Second)
		after := memTotal()
		resizedMemTotal = after
		t.Logf("guest MemTotal %d MiB before, %d MiB after set_memory_size 400M", before>>20, after>>20)
		assert.InDelta(t, float64(144<<20), float64(after-before), float64(8<<20), "the guest has 144 MiB more (256Mi -> 400Mi)")
		h.wait(pod.UID, 5*time.Second, "VMResized applied", func(p *corev1.Pod) bool {
			c := podCond(p, podstatus.ConditionVMResized)
			return c != nil && c.Status == corev1.ConditionTrue && c.Reason == podstatus.ReasonResizeApplied
		})
		assert.Contains(t, events.all(), "Normal Resized VM memory will be 400Mi from its next power on")

		// The exporter's LogStream told what happened (after the lines of
		// the earlier power cycle, which no stream had taken).
		const want = "memory will be 400M on next power on\npowering off\npowered off\npowering on\npowered on"
		var lines []string
		for !strings.HasSuffix(strings.Join(lines, "\n"), want) {
			r, err := logs.Recv()
			require.NoError(t, err, "lines so far: %q", lines)
			lines = append(lines, r.GetMessage())
		}
		assert.Contains(t, lines, "memory size 400M (419430400 bytes) requested for the next power on")
	})

	t.Run("FlashBadRefTouchesNothing", func(t *testing.T) {
		pids := vmtest.QEMUPids(dir)
		err := s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://" + reg.Addr + "/qemu-kubelet/nope:1", nil}, func(any) error { return nil })
		require.Error(t, err)
		assert.Contains(t, err.Error(), "not found")
		assert.Equal(t, pids, vmtest.QEMUPids(dir), "the VM was not touched")
		assert.Empty(t, vmStateFile(t, dir).FlashedImage)
	})

	t.Run("Flash", func(t *testing.T) {
		var lines []string
		// With registry credentials in the call (the test registry takes
		// anonymous pulls: they go unused, and must leave no trace).
		err := s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://" + flashRef, nil, "robot", registryPassword}, func(v any) error {
			lines = append(lines, fmt.Sprint(v))
			return nil
		})
		require.NoError(t, err, "progress: %v", lines)
		t.Logf("flash_oci progress: %v", lines)
		h.wait(pod.UID, 10*time.Second, "Running flashed", running)
		waitConsole(t, dir, vmtest.BootMarker+" variant=noacpi", 90*time.Second)
		st := vmStateFile(t, dir)
		assert.Contains(t, st.FlashedImage, vmtest.Repo+"@sha256:")
		p := h.wait(pod.UID, time.Second, "Running", running)
		assert.Contains(t, p.Status.ContainerStatuses[0].ImageID, st.FlashedImage)
		assert.Contains(t, events.all(), "Normal Flashed")
	})

	var flashedDigest string // of the root FlashLocalImageAndDump flashed
	t.Run("FlashLocalImageAndDump", func(t *testing.T) {
		// A bootable disk (SYSLINUX + the test kernel and acpi initramfs,
		// hack/build-test-image.sh) as a raw image, xz-compressed on the
		// client, flashed onto root through the router as a resource.
		raw := filepath.Join(t.TempDir(), "disk.raw")
		out, err := exec.Command("qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", filepath.Join(vmtest.BuildTestImages(t), "disk.qcow2"), raw).CombinedOutput()
		require.NoError(t, err, "%s", out)
		rawBytes, err := os.ReadFile(raw)
		require.NoError(t, err)
		sum := sha256.Sum256(rawBytes)
		digest := "sha256:" + hex.EncodeToString(sum[:])
		out, err = exec.Command("xz", "-1", "-k", raw).CombinedOutput()
		require.NoError(t, err, "%s", out)
		src, err := os.Open(raw + ".xz")
		require.NoError(t, err)
		defer src.Close()
		require.NoError(t, s.Flash(ctx, uuidOf("flasher"), src, "root", ""))

		p := h.wait(pod.UID, 10*time.Second, "Running the flashed disk", running)
		assert.Equal(t, "flash/root@"+digest, p.Status.ContainerStatuses[0].ImageID, "the pod shows what it boots")
		waitConsole(t, dir, vmtest.BootMarker+" variant=acpi", 180*time.Second)
		pids := vmtest.QEMUPids(dir)
		require.Len(t, pids, 1)
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pids[0]))
		require.NoError(t, err)
		assert.NotContains(t, string(cmdline), "-kernel", "booted through the firmware and the disk's own bootloader")
		st := vmStateFile(t, dir)
		assert.Equal(t, digest, st.Flashed["root"].Digest)
		assert.Empty(t, st.FlashedImage, "the flashed file replaced the flashed OCI image")
		assert.Contains(t, events.all(), "Normal Flashed Partition root replaced by a flashed raw image ("+digest)

		_, err = s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err)
		h.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		back := sha256.New()
		cw := &countWriter{w: back}
		require.NoError(t, s.Dump(ctx, uuidOf("flasher"), cw, jumpstarter.FlashedPrefix+"root", ""))
		assert.Equal(t, int64(len(rawBytes)), cw.n)
		assert.Equal(t, digest, "sha256:"+hex.EncodeToString(back.Sum(nil)), "dump flashed:root returns the flashed bytes")
		flashedDigest = digest
		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		h.wait(pod.UID, 10*time.Second, "Running", running)
	})

	t.Run("ResizeDisk", func(t *testing.T) {
		// The flashed root is a disk: set_disk_size grows it from the next
		// power on; a smaller size is refused at the call.
		waitConsole(t, dir, "QK-AGENT-OK", 180*time.Second)
		vdaBytes := func(vms *VMs) int64 {
			var io execIO
			require.NoError(t, vms.RunInContainer(ctx, "default", pod.Name, "vm", []string{"cat", "/sys/block/vda/size"}, &io))
			var sectors int64
			_, err := fmt.Sscanf(strings.TrimSpace(io.stdout.String()), "%d", &sectors)
			require.NoError(t, err, "%q", io.stdout.String())
			return sectors * 512
		}
		before := vdaBytes(h.vms)
		_, err := s.Call(ctx, uuidOf(""), "set_disk_size", "1M")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "Shrinking disk is not supported")
		_, err = s.Call(ctx, uuidOf(""), "set_disk_size", "100P")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "Not enough disk space")
		want := before + 64<<20
		_, err = s.Call(ctx, uuidOf(""), "set_disk_size", fmt.Sprint(want))
		require.NoError(t, err)
		assert.Equal(t, before, vdaBytes(h.vms), "the running VM keeps its disk")
		_, err = s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err)
		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		h.wait(pod.UID, 10*time.Second, "Running", running)
		waitConsole(t, dir, "QK-AGENT-OK", 180*time.Second)
		after := vdaBytes(h.vms)
		t.Logf("guest disk %d bytes before, %d after set_disk_size %d", before, after, want)
		assert.Equal(t, want, after, "the guest sees the grown disk")
		assert.Equal(t, want, vmStateFile(t, dir).Size.DiskBytes)
	})

	t.Run("DumpGuestDisk", func(t *testing.T) {
		// The guest writes known bytes to its disk (the last MiB, in the
		// room set_disk_size added: no file system there), the VM is
		// powered off, and dump root has them; dump while running is
		// refused; flashed:root is still the flashed file.
		require.NotEmpty(t, flashedDigest, "FlashLocalImageAndDump ran")
		waitConsole(t, dir, "QK-AGENT-OK", 180*time.Second)
		marker := fmt.Sprintf("QK-DUMP-MARKER-%d", time.Now().UnixNano())
		var out execIO
		require.NoError(t, h.vms.RunInContainer(ctx, "default", pod.Name, "vm", []string{"sh", "-c",
			`n=$(cat /sys/block/vda/size); printf '` + marker + `' | dd of=/dev/vda bs=512 seek=$((n-2048)) conv=notrunc,sync,fsync 2>/dev/null && sync && echo "$n"`}, &out))
		var sectors int64
		_, err := fmt.Sscanf(strings.TrimSpace(out.stdout.String()), "%d", &sectors)
		require.NoError(t, err, "%q %q", out.stdout.String(), out.stderr.String())
		off := (sectors - 2048) * 512

		err = s.Dump(ctx, uuidOf("flasher"), io.Discard, "root", "")
		require.Error(t, err, "dump root while the VM runs")
		assert.Contains(t, err.Error(), "the VM is running")
		assert.Contains(t, err.Error(), "power it off first")

		_, err = s.Call(ctx, uuidOf("power"), "off")
		require.NoError(t, err)
		h.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		win := &windowWriter{from: off, want: int64(len(marker))}
		require.NoError(t, s.Dump(ctx, uuidOf("flasher"), win, "root", ""))
		assert.Equal(t, sectors*512, win.n, "the whole disk, raw as its root (the grown size)")
		assert.Equal(t, marker, string(win.got), "the bytes the guest wrote, at their offset")

		back := sha256.New()
		require.NoError(t, s.Dump(ctx, uuidOf("flasher"), back, jumpstarter.FlashedPrefix+"root", ""))
		assert.Equal(t, flashedDigest, "sha256:"+hex.EncodeToString(back.Sum(nil)), "flashed:root is still what was flashed")
		_, err = s.Call(ctx, uuidOf("power"), "on")
		require.NoError(t, err)
		h.wait(pod.UID, 10*time.Second, "Running", running)
	})

	t.Run("SecretsLeaveNoTrace", func(t *testing.T) {
		assert.NotContains(t, events.all(), guestPassword)
		assert.NotContains(t, events.all(), registryPassword)
		p := h.wait(pod.UID, time.Second, "Running", running)
		b, _ := json.Marshal(p)
		assert.NotContains(t, string(b), guestPassword, "not in the pod's status")
		klog.Flush()
		require.Contains(t, agentLog.String(), "VM resized for the next power on", "the agent's log is captured")
		assert.NotContains(t, agentLog.String(), guestPassword, "not in the agent's log")
		assert.NotContains(t, agentLog.String(), registryPassword, "not in the agent's log")
		seed := filepath.Join(dir, podspec.VolumesDirName, podspec.CloudInitVolumeName+".img")
		require.NoError(t, filepath.Walk(root, func(path string, fi os.FileInfo, err error) error {
			if err != nil || fi.IsDir() || fi.Mode()&os.ModeSocket != 0 || filepath.Base(path) == filepath.Base(seed) {
				return nil
			}
			if b, err := os.ReadFile(path); err == nil {
				assert.NotContains(t, string(b), registryPassword, path)
				assert.NotContains(t, string(b), guestPassword, path)
			}
			return nil
		}))
	})

	t.Run("WrongTokenNoCrashLoop", func(t *testing.T) {
		p := h.wait(bad.UID, 60*time.Second, "exporter Failed", condReason("Failed"))
		c := exporterCond(p)
		assert.Contains(t, c.Message, "rejected the exporter token")
		assert.NotContains(t, c.Message, "not-the-token")
		h.wait(bad.UID, 60*time.Second, "Running", running)
		pids := vmtest.QEMUPids(badDir)
		require.Len(t, pids, 1)
		time.Sleep(3 * time.Second)
		p = h.wait(bad.UID, time.Second, "still Running", running)
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount)
		assert.Equal(t, pids, vmtest.QEMUPids(badDir), "the VM is never restarted for the exporter")
		assert.Contains(t, events.all(), "Warning ExporterFailed")
		assert.NotContains(t, events.all(), "not-the-token")
		assert.GreaterOrEqual(t, promtest.ToFloat64(metrics.JSRegistrations.WithLabelValues("token_rejected")), 1.0)
		require.NoError(t, h.vms.DeletePod(ctx, deleting(bad)))
		waitGoneDir(t, badDir, 30*time.Second)
	})

	t.Run("CrashLoopBackOffPowerOffAndOn", func(t *testing.T) {
		// A guest that panics at every boot, with a long back-off: power off
		// during the back-off keeps it off; power on starts it at once.
		runner := newFakeRunner()
		hb := newHarnessWith(t, filepath.Join(root, "state-backoff"), store, imageDir, func(c *VMsConfig) {
			c.VMUser = &qemu.User{UID: 107, GID: 107}
			c.Secrets = secrets.get
			c.Exporters = runner
			c.Backoff = podstatus.Backoff{Initial: time.Minute, Max: time.Minute}
		})
		cp := podFor("u-crash", refs[vmtest.VariantPanic], corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"})
		cdir := filepath.Join(root, "state-backoff", VMsDirName, "u-crash")
		require.NoError(t, hb.vms.CreatePod(ctx, cp))
		r := runner.next(t, 30*time.Second)
		hb.wait(cp.UID, 120*time.Second, "CrashLoopBackOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonCrashLoopBackOff })
		require.NoError(t, r.cfg.Target.PowerOff(ctx))
		p := hb.wait(cp.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		assert.Equal(t, int32(1), p.Status.ContainerStatuses[0].RestartCount)
		assert.Equal(t, podstatus.ReasonGuestPanicked, p.Status.ContainerStatuses[0].LastTerminationState.Terminated.Reason)
		assert.Empty(t, vmtest.QEMUPids(cdir))
		t0 := time.Now()
		require.NoError(t, r.cfg.Target.PowerOn(ctx), "returns once QEMU runs")
		assert.Less(t, time.Since(t0), 50*time.Second, "not after the minute of back-off")
		p = hb.wait(cp.UID, 5*time.Second, "Running again", running)
		assert.Equal(t, int32(1), p.Status.ContainerStatuses[0].RestartCount, "the restart was cancelled by the power off; a power on is no restart")
		require.NoError(t, hb.vms.DeletePod(ctx, deleting(cp)))
		waitGoneDir(t, cdir, 30*time.Second)
	})

	assert.GreaterOrEqual(t, promtest.ToFloat64(metrics.JSRegistrations.WithLabelValues("success")), 1.0)
	assert.GreaterOrEqual(t, promtest.ToFloat64(metrics.JSDriverCalls.WithLabelValues("power", "on", "OK")), 1.0)
	assert.Equal(t, 0.0, promtest.ToFloat64(metrics.JSStreams.WithLabelValues("console")), "closed streams are not counted")
	s.Close()

	t.Run("AgentRestart", func(t *testing.T) {
		before, _ := ctrl.ExporterState(ns, "board-0")
		h.cancel() // the agent stops: workers detach, VMs keep running
		time.Sleep(500 * time.Millisecond)
		require.Len(t, vmtest.QEMUPids(dir), 1)
		h2 := newHarnessWith(t, stateDir, store, imageDir, cfg)
		res, err := h2.vms.Recover(ctx)
		require.NoError(t, err)
		assert.Equal(t, 1, res.Running)
		_, err = h2.vms.GetPod(ctx, pod.Namespace, pod.Name)
		require.NoError(t, err)
		_, err = ctrl.WaitExporter(ctx, ns, "board-0", func(s jstest.ExporterState) bool {
			return s.Online && s.Registrations > before.Registrations
		})
		require.NoError(t, err, "the re-adopted VM's exporter registers again")
		h2.wait(pod.UID, 20*time.Second, "exporter Online/Leased again", func(p *corev1.Pod) bool {
			c := exporterCond(p)
			return c != nil && c.Status == corev1.ConditionTrue
		})
		s2, err := cl.Dial(ctx, "lease-1")
		require.NoError(t, err)
		defer s2.Close()
		rep, err := s2.GetReport(ctx)
		require.NoError(t, err)
		pw, ok := jstest.FindDriver(rep, "power")
		require.True(t, ok)
		// Off and on again: the flashed disk is still the one that boots.
		_, err = s2.Call(ctx, pw.GetUuid(), "off")
		require.NoError(t, err)
		h2.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		s2.Close()

		// The agent restarts again while the VM is off: it stays off (the
		// restart policy does not apply), its exporter comes back.
		before, _ = ctrl.ExporterState(ns, "board-0")
		h2.cancel()
		time.Sleep(500 * time.Millisecond)
		h3 := newHarnessWith(t, stateDir, store, imageDir, cfg)
		res, err = h3.vms.Recover(ctx)
		require.NoError(t, err)
		assert.Equal(t, 1, res.PoweredOff, "%+v", res)
		_, err = h3.vms.GetPod(ctx, pod.Namespace, pod.Name)
		require.NoError(t, err)
		_, err = ctrl.WaitExporter(ctx, ns, "board-0", func(s jstest.ExporterState) bool {
			return s.Online && s.Registrations > before.Registrations
		})
		require.NoError(t, err)
		p := h3.wait(pod.UID, 10*time.Second, "PoweredOff after the restart", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount)
		time.Sleep(2 * time.Second)
		assert.Empty(t, vmtest.QEMUPids(dir), "a powered-off VM stays off across an agent restart")
		s3, err := cl.Dial(ctx, "lease-1")
		require.NoError(t, err)
		defer s3.Close()
		_, err = s3.Call(ctx, pw.GetUuid(), "on")
		require.NoError(t, err)
		h3.wait(pod.UID, 10*time.Second, "Running", running)
		waitConsole(t, dir, vmtest.BootMarker+" variant=acpi", 180*time.Second)
		assert.Contains(t, vmStateFile(t, dir).Flashed, "root", "the flashed disk still boots")
		// The size set before both agent restarts still applies.
		assert.Equal(t, int64(400<<20), vmStateFile(t, dir).Size.MemoryBytes)
		h3.wait(pod.UID, 5*time.Second, "VMResized applied", func(p *corev1.Pod) bool {
			c := podCond(p, podstatus.ConditionVMResized)
			return c != nil && c.Reason == podstatus.ReasonResizeApplied
		})
		waitConsole(t, dir, "QK-AGENT-OK", 90*time.Second)
		if resizedMemTotal > 0 {
			assert.InDelta(t, float64(resizedMemTotal), float64(guestMemTotal(t, h3.vms)), float64(8<<20), "the guest still has the memory set before the agent restarts")
		}

		require.NoError(t, h3.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, dir, 30*time.Second)
		st, _ := ctrl.ExporterState(ns, "board-0")
		assert.True(t, st.Unregistered, "a deleted pod's exporter unregisters")
	})
}
