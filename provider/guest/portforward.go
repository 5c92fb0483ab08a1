package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// QEMU's user network accepts the host side of a forwarded connection at
// once and only then connects to the guest (SYN_SENT while the guest does
// not answer, e.g. still booting); a refusing guest makes QEMU close the host
// side. So "connected" on the host says nothing: awaitGuest asks QEMU
// (HMP `info usernet`) for the state of the connection behind the forward's
// host port, which is unique to one connection here (every forward gets its
// own host port and carries one connection at a time).

// AwaitGuest looks at QEMU's connections after guestPollFirst, then at
// doubling intervals up to guestPollMax (a guest on the same host answers in
// about a millisecond; a booting one takes seconds).
const (
	guestPollFirst = time.Millisecond
	guestPollMax   = 50 * time.Millisecond
)

// GuestAcceptTimeout bounds how long a port-forward connection waits for
// the guest to answer. A kubelet's port-forward is a connect(2) in the
// pod's network namespace, which waits for an unanswered SYN as long as the
// kernel retries it (about two minutes); a guest busy booting, or starved
// of CPU on a loaded host, answers late too, and kubectl ends the whole
// port-forward session on one connection's error, so the wait is long.
// A guest that refuses (nothing listens) is seen at once, whatever this is.
const GuestAcceptTimeout = 60 * time.Second

// ErrGuestPortClosed: nothing listens on the guest port.
var ErrGuestPortClosed = errors.New("connection refused by the guest (is anything listening on that port in the VM?)")

// ErrGuestNoAnswer: the guest did not answer the connection in time.
var ErrGuestNoAnswer = errors.New("the guest did not answer the connection (still booting, or a firewall drops it?)")

// guestAccepted reports whether QEMU (HMP `info usernet` output) shows a
// connection behind forward host port hostPort that the guest accepted:
// ESTABLISHED, or CLOSE_WAIT (accepted, then closed by the guest). Closing
// states of earlier connections through the same forward do not count, nor
// SYN_SENT (the guest has not answered) or the forward's own listening
// entry (HOST_FORWARD). Pure.
func guestAccepted(out string, hostPort int) bool {
	port := strconv.Itoa(hostPort)
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		// Protocol[State] FD SrcAddr SrcPort DstAddr DstPort RecvQ SendQ
		if len(f) < 6 || f[3] != port {
			continue
		}
		if f[0] == "TCP[ESTABLISHED]" || f[0] == "TCP[CLOSE_WAIT]" {
			return true
		}
	}
	return false
}

// UsernetQuery returns QEMU's `info usernet` text.
type UsernetQuery func(ctx context.Context) (string, error)

func Usernet(vm VM) UsernetQuery {
	return func(ctx context.Context) (string, error) {
		var out string
		err := vm.QMP(ctx, "human-monitor-command", map[string]any{"command-line": "info usernet"}, &out)
		return out, err
	}
}

// AwaitGuest waits up to timeout until the guest accepted the connection
// conn made to forward host port hostPort. Bytes the guest already sent
// are returned (they must reach the client). A closed connection before
// that is ErrGuestPortClosed; no answer in time is ErrGuestNoAnswer.
func AwaitGuest(ctx context.Context, query UsernetQuery, conn net.Conn, hostPort int, timeout time.Duration) ([]byte, error) {
	deadline := time.Now().Add(timeout)
	interval := guestPollFirst
	buf := make([]byte, 32<<10)
	defer conn.SetReadDeadline(time.Time{}) //nolint:errcheck // best effort
	for {
		out, err := query(ctx)
		if err != nil {
			return nil, fmt.Errorf("ask QEMU for the connection state: %w", err)
		}
		if guestAccepted(out, hostPort) {
			return nil, nil
		}
		// Not (yet) connected to the guest: QEMU may not have taken the
		// connection yet, the guest has not answered, or it refused and
		// QEMU closed the host side (seen as EOF below).
		if err := conn.SetReadDeadline(time.Now().Add(interval)); err != nil {
			return nil, err
		}
		interval = min(2*interval, guestPollMax)
		n, err := conn.Read(buf)
		switch {
		case n > 0:
			return buf[:n], nil // data from the guest: accepted
		case err == nil, errors.Is(err, os.ErrDeadlineExceeded):
		default:
			return nil, ErrGuestPortClosed
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if time.Now().After(deadline) {
			return nil, ErrGuestNoAnswer
		}
	}
}

// ForwardGuestPort connects stream (one kubectl port-forward connection) to
// guestPort of the VM: a runtime forward 127.0.0.1:<free port> -> guest
// port is added for this connection and removed when it ends. A guest port
// nothing listens on gives ErrGuestPortClosed.
func ForwardGuestPort(ctx context.Context, vm VM, guestPort int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	gc, first, err := dialGuest(ctx, vm, int(guestPort))
	if err != nil {
		return err
	}
	defer gc.Close()
	if len(first) > 0 {
		if _, err := stream.Write(first); err != nil {
			return nil // client gone
		}
	}
	return pipeBoth(ctx, gc.TCPConn, stream)
}

// guestConn is one connection to a guest port through its own runtime
// forward; Close also removes the forward.
type guestConn struct {
	*net.TCPConn
	remove func()
	once   sync.Once
}

func (c *guestConn) Close() error {
	err := c.TCPConn.Close()
	c.once.Do(c.remove)
	return err
}

// dialGuest connects to guestPort of the VM through a runtime forward
// (the one kubectl port-forward uses) and waits until the guest accepted:
// a port nothing listens on gives ErrGuestPortClosed. first holds bytes
// the guest already sent.
func dialGuest(ctx context.Context, vm VM, guestPort int) (*guestConn, []byte, error) {
	log := klog.FromContext(ctx)
	hostPort, err := vm.ForwardPort(ctx, guestPort, 0)
	if err != nil {
		return nil, nil, err
	}
	remove := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := vm.RemoveForward(rctx, hostPort); err != nil {
			log.Error(err, "Remove port-forward", "hostPort", hostPort)
		}
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(hostPort)))
	if err != nil {
		remove()
		return nil, nil, fmt.Errorf("connect to guest port %d: %w", guestPort, err)
	}
	first, err := AwaitGuest(ctx, Usernet(vm), conn, hostPort, GuestAcceptTimeout)
	if err != nil {
		conn.Close()
		remove()
		return nil, nil, fmt.Errorf("guest port %d: %w", guestPort, err)
	}
	return &guestConn{TCPConn: conn.(*net.TCPConn), remove: remove}, first, nil
}

// prefixedConn is a guest connection whose first reads return the bytes
// the guest sent before the caller got it.
type prefixedConn struct {
	*guestConn
	pending []byte
}

func (c *prefixedConn) Read(b []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(b, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.guestConn.Read(b)
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

// DialGuest connects to TCP port port of vm's guest (ErrGuestPortClosed
// when nothing listens there): the connection reads first what the guest
// sent while the dial checked it accepted.
func DialGuest(ctx context.Context, vm VM, port int) (net.Conn, error) {
	gc, first, err := dialGuest(ctx, vm, port)
	if err != nil {
		return nil, err
	}
	return &prefixedConn{guestConn: gc, pending: first}, nil
}
