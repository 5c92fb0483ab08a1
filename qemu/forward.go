package qemu

import (
	"context"
	"fmt"
	"net"
	"strings"
)

// FreeLoopbackPort returns a TCP port on 127.0.0.1 that was free a moment
// ago (the kernel picks it).
func FreeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ForwardPort forwards 127.0.0.1:hostPort to guestPort at runtime (HMP
// hostfwd_add via QMP human-monitor-command). hostPort 0 picks a free port:
// the port is free when picked but QEMU binds it a moment later, so a port
// taken in between (another forward, any process on the host) is retried
// with a new one, up to forwardPortTries times. Returns the host port.
func (vm *VM) ForwardPort(ctx context.Context, guestPort, hostPort int) (int, error) {
	if !vm.spec.Network {
		return 0, fmt.Errorf("forward guest port %d: VM %s has no network", guestPort, vm.spec.Name)
	}
	if guestPort < 1 || guestPort > 65535 || hostPort < 0 || hostPort > 65535 {
		return 0, fmt.Errorf("forward guest port %d to host port %d: port out of range", guestPort, hostPort)
	}
	add := func(hp int) (bool, error) { return vm.hostfwdAdd(ctx, hp, guestPort) }
	if hostPort != 0 {
		_, err := add(hostPort)
		if err != nil {
			return 0, err
		}
		return hostPort, nil
	}
	return forwardFreePort(forwardPortTries, FreeLoopbackPort, add)
}

// forwardFreePort picks a free port and adds a forward on it, picking again
// while add reports the port refused (taken since it was picked), up to
// tries picks; any other error ends it at once.
func forwardFreePort(tries int, pick func() (int, error), add func(hostPort int) (refused bool, err error)) (int, error) {
	var err error
	for range tries {
		hp, perr := pick()
		if perr != nil {
			return 0, perr
		}
		var refused bool
		if refused, err = add(hp); err == nil {
			return hp, nil
		} else if !refused {
			return 0, err
		}
	}
	return 0, fmt.Errorf("%w (%d free ports tried)", err, tries)
}

// forwardPortTries bounds ForwardPort's picks of a free host port.
const forwardPortTries = 5

// hostfwdAdd adds the forward; refused is QEMU's own refusal (it could not
// bind the host port), as opposed to a failed QMP call.
func (vm *VM) hostfwdAdd(ctx context.Context, hostPort, guestPort int) (refused bool, err error) {
	var out string
	cmd := fmt.Sprintf("hostfwd_add net0 tcp:127.0.0.1:%d-:%d", hostPort, guestPort)
	if err := vm.QMP(ctx, "human-monitor-command", map[string]any{"command-line": cmd}, &out); err != nil {
		return false, fmt.Errorf("forward guest port %d: %w", guestPort, err)
	}
	if s := strings.TrimSpace(out); s != "" {
		return true, fmt.Errorf("forward guest port %d to 127.0.0.1:%d: %s", guestPort, hostPort, s)
	}
	return false, nil
}

// RemoveForward removes a runtime or start-time forward of hostPort.
func (vm *VM) RemoveForward(ctx context.Context, hostPort int) error {
	var out string
	cmd := fmt.Sprintf("hostfwd_remove net0 tcp:127.0.0.1:%d", hostPort)
	if err := vm.QMP(ctx, "human-monitor-command", map[string]any{"command-line": cmd}, &out); err != nil {
		return fmt.Errorf("remove forward of host port %d: %w", hostPort, err)
	}
	if s := strings.TrimSpace(out); s != "" && !strings.Contains(s, "removed") {
		return fmt.Errorf("remove forward of host port %d: %s", hostPort, s)
	}
	return nil
}
