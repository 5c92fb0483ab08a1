package provider

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// ErrExecNeedsGuestAgent: `kubectl exec` into a VM runs the command through
// qemu-guest-agent on a virtio-serial channel; VMs are not given that
// channel yet, so exec is refused with this error.
var ErrExecNeedsGuestAgent = errors.New("kubectl exec into a VM pod needs qemu-guest-agent in the guest on a virtio-serial channel, which this VM does not have; use `kubectl attach -it` for the serial console or `kubectl port-forward` to reach a guest service (e.g. SSH)")

// execInVM serves RunInContainer: the pod must exist and the container be
// its one container; then the command is refused with
// ErrExecNeedsGuestAgent (an InvalidInput error, so the client sees a 4xx
// naming the reason rather than a server failure).
func (p *VMs) execInVM(_ context.Context, namespace, name, container string, cmd []string, _ api.AttachIO) error {
	if _, err := p.view(namespace, name, container); err != nil {
		return err
	}
	return invalidInput{fmt.Errorf("exec %q in pod %s/%s: %w", strings.Join(cmd, " "), namespace, name, ErrExecNeedsGuestAgent)}
}

// invalidInput is an errdefs InvalidInput error that still unwraps (for
// errors.Is), unlike errdefs.AsInvalidInput.
type invalidInput struct{ error }

func (e invalidInput) InvalidInput() bool { return true }
func (e invalidInput) Unwrap() error      { return e.error }
