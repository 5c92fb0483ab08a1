package guest

import (
	"context"
	"io"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// VM is what the kubelet API's streams (logs, attach, port-forward,
// exec) use of a running VM.
type VM interface {
	// Done is closed once the VM has ended and its Exit is known.
	Done() <-chan struct{}
	// GuestExec runs a command in the guest (its guest agent).
	GuestExec(ctx context.Context, req qemu.ExecRequest) (qemu.ExecResult, error)
	// ForwardPort forwards host port hostPort (0: any free one, returned)
	// to guest TCP port guestPort; RemoveForward removes it.
	ForwardPort(ctx context.Context, guestPort, hostPort int) (int, error)
	RemoveForward(ctx context.Context, hostPort int) error
	// AttachConsole is a connection to the serial console.
	AttachConsole(ctx context.Context) (io.ReadWriteCloser, error)
	// QMP runs a QEMU monitor command, decoding its return into out.
	QMP(ctx context.Context, command string, args, out any) error
}
