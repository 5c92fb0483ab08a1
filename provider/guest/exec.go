package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"k8s.io/klog/v2"
	utilexec "k8s.io/utils/exec"
)

// `kubectl exec` into a VM runs the command through qemu-guest-agent on the
// VM's virtio-serial channel (VM.GuestExec): the command's argv is
// guest-exec's path and args (no shell on either side), its stdin is read
// whole first (at most qemu.MaxExecStdin bytes; kubectl exec -i ends it at
// the end of its input), then it runs; its stdout and stderr (each at most
// qemu.MaxExecOutput bytes) are written back once it exited, and its exit
// code reaches kubectl. QGA's guest-exec is not interactive, so a tty
// (kubectl exec -t) is refused.

// ExecTimeout bounds one kubectl exec, reading stdin included. A command
// still running then is left running in the guest (QGA cannot stop it).
var ExecTimeout = 5 * time.Minute

// ErrExecTTY: kubectl exec -t asks for an interactive terminal.
var ErrExecTTY = errors.New("interactive exec with a tty (kubectl exec -t) is not supported by VM pods: commands run through qemu-guest-agent's guest-exec, which takes the whole stdin first and returns the output when the command exited; drop -t (kubectl exec -i works), or use kubectl attach -it for the serial console")

// Exec runs cmd in the guest of vm, the VM of pod namespace/name (see
// above).
func Exec(ctx context.Context, vm VM, namespace, name string, cmd []string, attach api.AttachIO) error {
	if len(cmd) == 0 || cmd[0] == "" {
		return errdefs.InvalidInputf("exec in pod %s/%s: no command given", namespace, name)
	}
	if attach != nil && attach.TTY() {
		return invalidInput{fmt.Errorf("exec in pod %s/%s: %w", namespace, name, ErrExecTTY)}
	}
	ctx, cancel := context.WithTimeout(ctx, ExecTimeout)
	defer cancel()
	klog.FromContext(ctx).V(2).Info("Exec in VM", "pod", klog.KRef(namespace, name), "command", cmd[0], "args", len(cmd)-1)

	var stdin []byte
	if attach != nil && attach.Stdin() != nil {
		var err error
		if stdin, err = readStdin(ctx, attach.Stdin()); err != nil {
			return fmt.Errorf("exec %s in pod %s/%s: stdin: %w", cmd[0], namespace, name, err)
		}
	}
	res, err := vm.GuestExec(ctx, qemu.ExecRequest{Path: cmd[0], Args: cmd[1:], Stdin: stdin})
	if err != nil {
		return fmt.Errorf("exec %s in pod %s/%s: %w", cmd[0], namespace, name, err)
	}
	if attach != nil {
		if w := attach.Stdout(); w != nil {
			_, _ = w.Write(res.Stdout)
		}
		if w := attach.Stderr(); w != nil {
			_, _ = w.Write(res.Stderr)
			if res.Truncated {
				fmt.Fprintf(w, "[qemu-kubelet: the guest agent truncated the output]\n")
			}
		}
	}
	if res.ExitCode != 0 {
		// Not wrapped: the kubelet API server type-asserts ExitError to send
		// the exit code to kubectl.
		return utilexec.CodeExitError{Err: fmt.Errorf("command %s terminated with exit code %d", cmd[0], res.ExitCode), Code: res.ExitCode}
	}
	return nil
}

// readStdin reads r to its end, at most qemu.MaxExecStdin bytes, or until
// ctx ends.
func readStdin(ctx context.Context, r io.Reader) ([]byte, error) {
	type result struct {
		b   []byte
		err error
	}
	ch := make(chan result, 1)
	go func() { // ends when the stream ends (the connection closes with the exec)
		b, err := io.ReadAll(io.LimitReader(r, qemu.MaxExecStdin+1))
		ch <- result{b, err}
	}()
	select {
	case res := <-ch:
		if res.err != nil {
			return nil, res.err
		}
		if len(res.b) > qemu.MaxExecStdin {
			return nil, qemu.ErrExecStdinTooLarge
		}
		return res.b, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("still open when the exec timed out (the command runs once its stdin ended): %w", ctx.Err())
	}
}

// invalidInput is an errdefs InvalidInput error that still unwraps (for
// errors.Is), unlike errdefs.AsInvalidInput.
type invalidInput struct{ error }

func (e invalidInput) InvalidInput() bool { return true }
func (e invalidInput) Unwrap() error      { return e.error }
