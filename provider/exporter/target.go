package exporter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
)

// The VM as a jumpstarter.Target.

// Target is one pod's VM as its exporter sees it. Power and flash are
// requests to the pod's worker; console and guest connections use the
// running VM as kubectl attach and port-forward do.
type Target struct {
	node *Node
	pod  Pod
}

// NewTarget is pod's VM as a target of an exporter of node.
func NewTarget(node *Node, pod Pod) *Target { return &Target{node: node, pod: pod} }

var (
	_ jumpstarter.Target      = (*Target)(nil)
	_ jumpstarter.Displayer   = (*Target)(nil)
	_ jumpstarter.OCIFlasher  = (*Target)(nil)
	_ jumpstarter.Shutdowner  = (*Target)(nil)
	_ jumpstarter.GuestExecer = (*Target)(nil)
)

// PodPowerOffNow is a Pod whose worker can stop the VM at once: QEMU told
// to quit, killed if it has not within its quit grace, the guest not shut
// down (upstream's QEMU power off). Pod.PowerOff is the graceful stop.
type PodPowerOffNow interface {
	PowerOffNow(ctx context.Context) error
}

func (t *Target) PowerOn(ctx context.Context) error { return t.pod.PowerOn(ctx) }

// PowerOff is the power driver's off: at once when the pod's worker
// offers it (PodPowerOffNow), otherwise the graceful stop.
func (t *Target) PowerOff(ctx context.Context) error {
	if p, ok := t.pod.(PodPowerOffNow); ok {
		return p.PowerOffNow(ctx)
	}
	return t.pod.PowerOff(ctx)
}

// Shutdown is the power driver's shutdown: the ACPI power button within
// the pod's grace period, then quit, then kill, as for a delete.
func (t *Target) Shutdown(ctx context.Context) error { return t.pod.PowerOff(ctx) }

func (t *Target) Powered() bool { return t.vm() != nil }

func (t *Target) vm() VM { return t.pod.VM() }

// Console attaches to the serial console. Reading needs nothing; the first
// Write takes the console writer lock shared (guest.ShareConsoleWriter):
// the lease's console sessions type together, as on upstream's pty
// console, while a kubectl attach -i, which takes it exclusively, is
// refused beside them (and refuses them: guest.ErrConsoleHeldByAttach).
func (t *Target) Console(ctx context.Context) (io.ReadWriteCloser, error) {
	vm := t.vm()
	if vm == nil {
		return nil, fmt.Errorf("console: %w", ErrVMPoweredOff)
	}
	c, err := vm.AttachConsole(ctx)
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	return &consoleSession{ReadWriteCloser: c, dir: t.pod.Dir()}, nil
}

// DialGuest connects to a guest TCP port (ErrGuestPortClosed when nothing
// listens there).
func (t *Target) DialGuest(ctx context.Context, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("guest port %d: not in 1-65535", port)
	}
	vm := t.vm()
	if vm == nil {
		return nil, fmt.Errorf("guest port %d: %w", port, ErrVMPoweredOff)
	}
	return guest.DialGuest(ctx, vm, port)
}

// Flash pulls and verifies ref through the node's image store before
// anything else; then the worker powers the VM off, makes ref the image it
// boots and powers it on again if it was on. A lease pulls only what
// anyone may pull (flashPullOptions): never with the pod's pull secrets.
func (t *Target) Flash(ctx context.Context, ref string, progress func(string)) error {
	return t.flash(ctx, ref, oci.PullOptions{}, progress)
}

// FlashOCI is a lease's flash_oci: the image pulled with the call's
// registry credentials (used for this pull only and kept nowhere) and
// dialler, its disk onto f.Partition (root: as Flash; a firmware
// partition: as WritePartition).
func (t *Target) FlashOCI(ctx context.Context, f jumpstarter.OCIFlash, progress func(string)) error {
	opts := oci.PullOptions{Dial: f.Dial}
	if c := f.Credentials; c != nil {
		opts.Credentials = &oci.Credentials{Username: c.Username, Password: c.Password}
	}
	if f.Partition == jumpstarter.PartitionRoot || f.Partition == "" {
		return t.flash(ctx, f.Ref, opts, progress)
	}
	return t.flashOCIPartition(ctx, f.Ref, f.Partition, opts, progress) // flash.go
}

// GuestExec runs argv in the running guest through qemu-guest-agent, as
// kubectl exec does (a hook's exec step). A guest agent that does not
// answer (a guest still booting) is jumpstarter.ErrGuestAgentNotReady; a
// powered-off VM is ErrVMPoweredOff.
func (t *Target) GuestExec(ctx context.Context, argv []string) (jumpstarter.GuestExecResult, error) {
	if len(argv) == 0 {
		return jumpstarter.GuestExecResult{}, errors.New("exec in the guest: no command")
	}
	vm := t.vm()
	if vm == nil {
		return jumpstarter.GuestExecResult{}, fmt.Errorf("exec %s in the guest: %w", argv[0], ErrVMPoweredOff)
	}
	res, err := vm.GuestExec(ctx, qemu.ExecRequest{Path: argv[0], Args: argv[1:]})
	if errors.Is(err, qemu.ErrGuestAgentNotResponding) {
		return jumpstarter.GuestExecResult{}, fmt.Errorf("exec %s in the guest: %w: %w", argv[0], jumpstarter.ErrGuestAgentNotReady, err)
	}
	if err != nil {
		return jumpstarter.GuestExecResult{}, fmt.Errorf("exec %s in the guest: %w", argv[0], err)
	}
	return jumpstarter.GuestExecResult{ExitCode: res.ExitCode, Stderr: res.Stderr}, nil
}

// Display connects to the VM's VNC server (a pod with a display).
func (t *Target) Display(ctx context.Context) (io.ReadWriteCloser, error) {
	vm := t.vm()
	if vm == nil {
		return nil, fmt.Errorf("display: %w", ErrVMPoweredOff)
	}
	return vm.DialDisplay(ctx)
}

func (t *Target) flash(ctx context.Context, ref string, opts oci.PullOptions, progress func(string)) error {
	if progress == nil {
		progress = func(string) {}
	}
	ref = strings.TrimPrefix(strings.TrimSpace(ref), "oci://")
	if t.node.Images == nil {
		return errors.New("flash: this node has no image store")
	}
	progress(fmt.Sprintf("pulling %s", ref))
	t.pod.Event(corev1.EventTypeNormal, "Pulling", fmt.Sprintf("Pulling image %q to flash", ref))
	t0 := time.Now()
	img, err := t.node.Images.Pull(ctx, ref, flashPullOptions(opts, progress))
	if err != nil {
		t.pod.Event(corev1.EventTypeWarning, "FlashFailed", fmt.Sprintf("Failed to pull image %q to flash: %v", ref, err))
		return fmt.Errorf("flash %s: %w", ref, err)
	}
	t.pod.Event(corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Successfully pulled image %q (%s) in %s", ref, img.Digest, time.Since(t0).Round(time.Millisecond)))
	progress(fmt.Sprintf("pulled %s (%s)", ref, img.Digest))
	hold, err := t.node.Images.Acquire(img.Digest)
	if err != nil {
		return fmt.Errorf("flash %s: hold the image: %w", ref, err)
	}
	was := t.Powered()
	if was {
		progress("powering off, replacing the disk and powering on")
	} else {
		progress("replacing the disk (the VM stays off)")
	}
	if err := t.pod.Flash(ctx, &Flash{Image: img, Hold: hold}); err != nil {
		t.pod.Event(corev1.EventTypeWarning, "FlashFailed", fmt.Sprintf("Flash of image %q: %v", ref, err))
		return fmt.Errorf("flash %s: %w", ref, err)
	}
	progress(fmt.Sprintf("flashed %s", podspec.ImageID(img)))
	return nil
}

// flashPullOptions are the pull options of a lease's flash_oci: the
// call's own credentials (none: anonymous) and dialler, never the pod's
// pull secrets (a lease holder is not the pod's owner), and policy Always
// with ProveAccess, even for a digest the node has cached: the registry
// must hand over the manifest's bytes to the caller's credentials first,
// so a cached image is served only to a caller who could pull it (the
// store then takes it from its cache, no layer downloaded again). The
// download's byte counts go to progress as paced lines ("pulled 12.0 MiB
// of 48.0 MiB (25%)": jumpstarter.ProgressLines).
func flashPullOptions(opts oci.PullOptions, progress func(string)) oci.PullOptions {
	meter := &jumpstarter.ProgressLines{Verb: "pulled", Emit: progress}
	return oci.PullOptions{Credentials: opts.Credentials, Dial: opts.Dial, Policy: oci.PullAlways, ProveAccess: true,
		Progress: func(p oci.Progress) { meter.Update(p.Done, p.Total) }}
}

// consoleSession is one exporter console stream.
type consoleSession struct {
	io.ReadWriteCloser
	dir string

	mu      sync.Mutex
	release func() // console writer lock (shared), once the session wrote
	closed  bool
}

func (c *consoleSession) Write(b []byte) (int, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, io.ErrClosedPipe
	}
	if c.release == nil {
		rel, err := guest.ShareConsoleWriter(c.dir)
		if err != nil {
			c.mu.Unlock()
			return 0, fmt.Errorf("console: %w", err)
		}
		c.release = rel
	}
	c.mu.Unlock()
	return c.ReadWriteCloser.Write(b)
}

func (c *consoleSession) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	rel := c.release
	c.release = nil
	c.mu.Unlock()
	if rel != nil {
		rel()
	}
	return c.ReadWriteCloser.Close()
}
