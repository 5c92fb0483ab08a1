package exporter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// anyPod names Pod for embedding (Pod has a method Pod).
type anyPod = Pod

// powerPod records which stop its exporter asked for.
type powerPod struct {
	anyPod // the rest is not used here
	calls  []string
}

func (p *powerPod) PowerOff(context.Context) error { p.calls = append(p.calls, "graceful"); return nil }

// nowPod can also stop the VM at once.
type nowPod struct{ powerPod }

func (p *nowPod) PowerOffNow(context.Context) error { p.calls = append(p.calls, "now"); return nil }

// TestTargetPowerOff: the power driver's off is the worker's immediate
// stop when the pod offers it, the graceful one otherwise; shutdown is
// always the graceful stop (ACPI power button within the pod's grace).
func TestTargetPowerOff(t *testing.T) {
	ctx := context.Background()
	now := &nowPod{}
	tgt := NewTarget(&Node{}, now)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"now", "graceful"}, now.calls)

	old := &powerPod{}
	tgt = NewTarget(&Node{}, old)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"graceful", "graceful"}, old.calls, "a pod without PowerOffNow stops gracefully")
}

// execVM is a running VM whose guest agent answers GuestExec with res or
// err, recording the requests.
type execVM struct {
	VM   // the rest is not used here
	res  qemu.ExecResult
	err  error
	reqs []qemu.ExecRequest
}

func (v *execVM) GuestExec(_ context.Context, req qemu.ExecRequest) (qemu.ExecResult, error) {
	v.reqs = append(v.reqs, req)
	return v.res, v.err
}

// execPod runs vm (nil: powered off).
type execPod struct {
	anyPod
	vm *execVM
}

func (p *execPod) VM() VM {
	if p.vm == nil {
		return nil
	}
	return p.vm
}

// TestTargetGuestExec: a hook's exec step runs its argv through the
// guest agent; a guest agent that does not answer yet is the error the
// hook tries again on, anything else is not, and a powered-off VM says so.
func TestTargetGuestExec(t *testing.T) {
	ctx := context.Background()
	vm := &execVM{res: qemu.ExecResult{ExitCode: 2, Stdout: []byte("out"), Stderr: []byte("no such file")}}
	tgt := NewTarget(&Node{}, &execPod{vm: vm})
	res, err := tgt.GuestExec(ctx, []string{"/bin/ls", "-l", "/gone"})
	require.NoError(t, err)
	assert.Equal(t, jumpstarter.GuestExecResult{ExitCode: 2, Stderr: []byte("no such file")}, res)
	assert.Equal(t, []qemu.ExecRequest{{Path: "/bin/ls", Args: []string{"-l", "/gone"}}}, vm.reqs)

	vm.err = fmt.Errorf("%w on VM x: no answer to the handshake within 5s", qemu.ErrGuestAgentNotResponding)
	_, err = tgt.GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, jumpstarter.ErrGuestAgentNotReady, "a booting guest: try again")
	assert.ErrorContains(t, err, "no answer to the handshake")

	vm.err = fmt.Errorf("VM x: %w", qemu.ErrNoGuestAgentChannel)
	_, err = tgt.GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, qemu.ErrNoGuestAgentChannel)
	assert.NotErrorIs(t, err, jumpstarter.ErrGuestAgentNotReady, "no channel: trying again cannot help")

	_, err = NewTarget(&Node{}, &execPod{}).GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, ErrVMPoweredOff)
	_, err = tgt.GuestExec(ctx, nil)
	require.ErrorContains(t, err, "no command")
}

// consolePod is a pod whose VM's console is a pipe per attachment.
type consolePod struct {
	anyPod // the rest is not used here
	dir    string
	vm     *pipeVM
}

func (p *consolePod) Dir() string { return p.dir }
func (p *consolePod) VM() VM      { return p.vm }

// pipeVM hands the guest side of each console attachment to guests.
type pipeVM struct {
	VM     // the rest is not used here
	guests chan net.Conn
}

func (v *pipeVM) AttachConsole(context.Context) (io.ReadWriteCloser, error) {
	c, g := net.Pipe()
	v.guests <- g
	return c, nil
}

// TestConsoleSessionsTypeTogether: the lease's console sessions type
// together, as on upstream's pty console (the writer lock shared); a
// kubectl attach -i is refused beside them, and refuses them while it
// types, with an error saying so and nothing written.
func TestConsoleSessionsTypeTogether(t *testing.T) {
	ctx := context.Background()
	vm := &pipeVM{guests: make(chan net.Conn, 4)}
	pod := &consolePod{dir: t.TempDir(), vm: vm}
	tgt := NewTarget(&Node{}, pod)
	open := func() (io.ReadWriteCloser, net.Conn) {
		c, err := tgt.Console(ctx)
		require.NoError(t, err)
		g := <-vm.guests
		t.Cleanup(func() { g.Close() })
		return c, g
	}
	// write writes s on a session and checks that the guest read it.
	write := func(c io.Writer, g net.Conn, s string) {
		t.Helper()
		got := make(chan string, 1)
		go func() {
			b := make([]byte, len(s))
			n, _ := io.ReadFull(g, b)
			got <- string(b[:n])
		}()
		_, err := io.WriteString(c, s)
		require.NoError(t, err)
		assert.Equal(t, s, <-got)
	}

	a, ga := open()
	b, gb := open()
	write(a, ga, "from-a\n")
	write(b, gb, "from-b\n")
	write(a, ga, "again-a\n")
	_, err := guest.LockConsoleWriter(pod.dir)
	assert.ErrorIs(t, err, guest.ErrConsoleBusy, "kubectl attach -i is refused while the lease types")
	require.NoError(t, a.Close())
	require.NoError(t, b.Close())

	release, err := guest.LockConsoleWriter(pod.dir)
	require.NoError(t, err, "kubectl attach -i types once the lease's sessions closed")
	c, gc := open()
	n, err := c.Write([]byte("refused\n"))
	assert.ErrorIs(t, err, guest.ErrConsoleHeldByAttach)
	assert.Zero(t, n, "nothing written beside kubectl attach -i")
	release()
	write(c, gc, "after-attach\n")
	require.NoError(t, c.Close())
}

// pullImages is an image store whose pulls report progress (80 blocks of
// 128 KiB, as a registry download would) before they end with img or err.
type pullImages struct {
	img *oci.Image
	err error
}

func (p *pullImages) Pull(_ context.Context, ref string, opts oci.PullOptions) (*oci.Image, error) {
	const total = 10 << 20
	for done := int64(128 << 10); done <= total; done += 128 << 10 {
		opts.Progress(oci.Progress{Ref: ref, Done: done, Total: total})
	}
	return p.img, p.err
}
func (p *pullImages) Acquire(string) (func(), error) { return func() {}, nil }

// flashPod records the flashes the worker would install.
type flashPod struct {
	anyPod  // the rest is not used here
	flashed []string
}

func (p *flashPod) VM() VM                       { return nil }
func (p *flashPod) Event(string, string, string) {}
func (p *flashPod) Flash(_ context.Context, f *Flash) error {
	p.flashed = append(p.flashed, f.Image.Digest)
	return nil
}

// TestFlashPullProgress: a flash_oci's progress (its streamed output and
// the lease's LogStream) says how far the pull is, by tenths of the
// image, not per block, then what the flash does; a failed pull says how
// far it got.
func TestFlashPullProgress(t *testing.T) {
	ctx := context.Background()
	img := &oci.Image{Ref: "r/os:2", Digest: "sha256:" + strings.Repeat("a", 64), Disk: "/images/a/disk.qcow2"}
	pod := &flashPod{}
	tgt := NewTarget(&Node{Images: &pullImages{img: img}}, pod)
	var lines []string
	require.NoError(t, tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: "r/os:2", Partition: jumpstarter.PartitionRoot}, func(l string) { lines = append(lines, l) }))
	want := []string{"pulling r/os:2"}
	for i := 1; i <= 10; i++ {
		want = append(want, fmt.Sprintf("pulled %d.0 MiB of 10.0 MiB (%d%%)", i, i*10))
	}
	want = append(want, "pulled r/os:2 ("+img.Digest+")", "replacing the disk (the VM stays off)", "flashed "+podspec.ImageID(img))
	assert.Equal(t, want, lines)
	assert.Equal(t, []string{img.Digest}, pod.flashed)

	lines = nil
	tgt = NewTarget(&Node{Images: &pullImages{err: errors.New("registry went away")}}, pod)
	err := tgt.Flash(ctx, "oci://r/os:3", func(l string) { lines = append(lines, l) })
	require.ErrorContains(t, err, "registry went away")
	assert.Len(t, lines, 11, "%q", lines)
	assert.Equal(t, "pulled 10.0 MiB of 10.0 MiB (100%)", lines[10])
	assert.Len(t, pod.flashed, 1, "nothing installed")
}
