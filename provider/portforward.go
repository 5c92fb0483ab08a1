package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"k8s.io/klog/v2"
)

// guestRefusedWindow is how long a forwarded connection is watched for an
// immediate close before it is treated as established. QEMU's user network
// accepts the host side at once and connects to the guest afterwards; when
// the guest refuses, QEMU closes the host side within a few milliseconds
// (longer under TCG on a loaded host), with no byte sent.
const guestRefusedWindow = 500 * time.Millisecond

// ErrGuestPortClosed: nothing listens on the guest port.
var ErrGuestPortClosed = errors.New("connection refused by the guest (is anything listening on that port in the VM?)")

// ForwardGuestPort connects stream (one kubectl port-forward connection) to
// guestPort of the VM: a runtime forward 127.0.0.1:<free port> -> guest
// port is added for this connection and removed when it ends. A guest port
// nothing listens on gives ErrGuestPortClosed.
func ForwardGuestPort(ctx context.Context, vm *qemu.VM, guestPort int32, stream io.ReadWriteCloser) error {
	log := klog.FromContext(ctx)
	defer stream.Close()
	hostPort, err := vm.ForwardPort(ctx, int(guestPort), 0)
	if err != nil {
		return err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := vm.RemoveForward(rctx, hostPort); err != nil {
			log.Error(err, "Remove port-forward", "hostPort", hostPort)
		}
	}()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(hostPort)))
	if err != nil {
		return fmt.Errorf("connect to guest port %d: %w", guestPort, err)
	}
	defer conn.Close()

	// Refused by the guest? Watch briefly for a close with no data; keep
	// whatever the guest sends first (e.g. an SSH banner).
	first, err := readFirst(conn, guestRefusedWindow)
	if err != nil {
		return fmt.Errorf("guest port %d: %w", guestPort, err)
	}
	if len(first) > 0 {
		if _, err := stream.Write(first); err != nil {
			return nil // client gone
		}
	}
	return pipeBoth(ctx, conn.(*net.TCPConn), stream)
}

// readFirst waits up to window for the first bytes from conn: data is
// returned; a timeout returns nothing (an established, quiet connection);
// EOF or a reset before any data is ErrGuestPortClosed.
func readFirst(conn net.Conn, window time.Duration) ([]byte, error) {
	if err := conn.SetReadDeadline(time.Now().Add(window)); err != nil {
		return nil, err
	}
	defer conn.SetReadDeadline(time.Time{}) //nolint:errcheck // best effort
	buf := make([]byte, 32<<10)
	n, err := conn.Read(buf)
	switch {
	case n > 0:
		return buf[:n], nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, nil
	case err != nil:
		return nil, ErrGuestPortClosed
	}
	return nil, nil
}

// pipeBoth copies both ways until the guest side ends (or ctx ends): the
// end of the client's data half-closes the guest connection; the guest
// closing ends the forward (the caller closes the stream, which ends the
// other direction).
func pipeBoth(ctx context.Context, conn *net.TCPConn, stream io.ReadWriteCloser) error {
	go func() {
		io.Copy(conn, stream) //nolint:errcheck // ends with either side
		conn.CloseWrite()     //nolint:errcheck
	}()
	done := make(chan struct{})
	go func() {
		io.Copy(stream, conn) //nolint:errcheck // ends with either side
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		conn.Close()
		<-done
	}
	return nil
}

// portForward serves PortForward.
func (p *VMs) portForward(ctx context.Context, namespace, name string, port int32, stream io.ReadWriteCloser) error {
	v, err := p.view(namespace, name, "")
	if err != nil {
		stream.Close()
		return err
	}
	if v.vm == nil {
		stream.Close()
		return errdefs.InvalidInputf("port-forward to pod %s/%s: its VM is not running", namespace, name)
	}
	if err := ForwardGuestPort(ctx, v.vm, port, stream); err != nil {
		return fmt.Errorf("port-forward to port %d of pod %s/%s: %w", port, namespace, name, err)
	}
	return nil
}
