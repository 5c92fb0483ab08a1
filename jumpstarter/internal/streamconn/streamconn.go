// Package streamconn turns one RouterService.Stream (either side) into a
// net.Conn: DATA frames carry the bytes, GOAWAY and RST_STREAM end the read
// side, PING frames are ignored. It is how a whole gRPC (HTTP/2) connection
// travels through Jumpstarter's router, and how byte streams (console, TCP)
// travel inside that connection.
package streamconn

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// MaxFrame bounds the payload of one DATA frame written (gRPC's default
// message limit is 4 MiB; smaller frames keep latency low). A frame with
// its protobuf framing stays within 32 KiB: gRPC's buffer pool serves a
// message from the smallest tier that holds it (…, 32 KiB, 1 MiB) and
// zeroes the whole buffer, so 32 KiB of payload plus a few bytes cost a
// megabyte each.
const MaxFrame = 32<<10 - 64

// CloseGrace bounds how long Close leaves the stream open after its GOAWAY
// for the peer to end it (see Close).
const CloseGrace = 2 * time.Second

// Frames is one side of a RouterService.Stream.
type Frames interface {
	Send(payload []byte, ft pb.FrameType) error
	// Recv returns the next frame; io.EOF when the peer ended the stream.
	Recv() ([]byte, pb.FrameType, error)
	// CloseSend half-closes the sending side (a no-op on a server stream).
	CloseSend() error
}

// ClientFrames adapts the client side of RouterService.Stream.
func ClientFrames(s pb.RouterService_StreamClient) Frames { return clientFrames{s} }

// ServerFrames adapts the server side of RouterService.Stream.
func ServerFrames(s pb.RouterService_StreamServer) Frames { return serverFrames{s} }

type clientFrames struct{ s pb.RouterService_StreamClient }

func (c clientFrames) Send(p []byte, ft pb.FrameType) error {
	return c.s.Send(&pb.StreamRequest{Payload: p, FrameType: ft})
}
func (c clientFrames) Recv() ([]byte, pb.FrameType, error) {
	m, err := c.s.Recv()
	if err != nil {
		return nil, 0, err
	}
	return m.GetPayload(), m.GetFrameType(), nil
}
func (c clientFrames) CloseSend() error { return c.s.CloseSend() }

type serverFrames struct{ s pb.RouterService_StreamServer }

func (c serverFrames) Send(p []byte, ft pb.FrameType) error {
	return c.s.Send(&pb.StreamResponse{Payload: p, FrameType: ft})
}
func (c serverFrames) Recv() ([]byte, pb.FrameType, error) {
	m, err := c.s.Recv()
	if err != nil {
		return nil, 0, err
	}
	return m.GetPayload(), m.GetFrameType(), nil
}
func (c serverFrames) CloseSend() error { return nil }

// Addr is the address both ends of a Conn report.
type Addr string

func (a Addr) Network() string { return "jumpstarter-router" }
func (a Addr) String() string  { return string(a) }

// Conn is a net.Conn over Frames. Reads come from one goroutine that owns
// Recv; writes are serialised; Close sends GOAWAY once, half-closes and
// calls the cancel function that ends the underlying stream once the peer
// has ended it (or after CloseGrace).
type Conn struct {
	f      Frames
	cancel context.CancelFunc
	addr   Addr

	data     chan []byte   // owned by the receive goroutine (closed on end)
	recvDone chan struct{} // closed when the receive goroutine ends
	finished chan struct{} // closed when the stream is over (Finished)
	done     chan struct{} // closed by Close
	rerr     error         // set before data is closed
	buf      []byte        // unread rest of the last frame (Read side only)
	frame    []byte        // the frame buf is the rest of, released once read
	readMu   sync.Mutex

	writeMu   sync.Mutex
	maxFrame  int // payload bound of a DATA frame written (writeMu)
	closeOnce sync.Once

	dlMu          sync.Mutex
	readDeadline  time.Time
	deadlineWake  chan struct{} // replaced on every SetReadDeadline
	writeDeadline time.Time
}

// New wraps f. cancel (may be nil) ends the stream's context on Close.
func New(f Frames, cancel context.CancelFunc, addr string) *Conn {
	c := &Conn{f: f, cancel: cancel, addr: Addr(addr), maxFrame: MaxFrame, data: make(chan []byte, 4), recvDone: make(chan struct{}),
		finished: make(chan struct{}), done: make(chan struct{}), deadlineWake: make(chan struct{})}
	go c.recvLoop()
	return c
}

func (c *Conn) recvLoop() {
	defer close(c.recvDone)
	defer close(c.data)
	for {
		p, ft, err := c.f.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				c.rerr = err
			}
			return
		}
		switch ft {
		case pb.FrameType_FRAME_TYPE_DATA:
			if len(p) == 0 {
				continue
			}
			select {
			case c.data <- p:
			case <-c.done:
				return
			}
		case pb.FrameType_FRAME_TYPE_GOAWAY, pb.FrameType_FRAME_TYPE_RST_STREAM:
			return
		default: // PING and unknown frames are ignored, like upstream
		}
	}
}

// Read implements net.Conn.
func (c *Conn) Read(b []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	for len(c.buf) == 0 {
		c.dlMu.Lock()
		dl, wake := c.readDeadline, c.deadlineWake
		c.dlMu.Unlock()
		var d time.Duration
		if !dl.IsZero() {
			if d = time.Until(dl); d <= 0 {
				return 0, os.ErrDeadlineExceeded
			}
		}
		select {
		case <-c.done:
			return 0, net.ErrClosed
		default:
		}
		select { // a frame already waiting needs no timer
		case p, ok := <-c.data:
			if !ok {
				if c.rerr != nil {
					return 0, c.rerr
				}
				return 0, io.EOF
			}
			c.buf, c.frame = p, p
			continue
		default:
		}
		var timer <-chan time.Time
		if d > 0 {
			t := time.NewTimer(d)
			defer t.Stop()
			timer = t.C
		}
		select {
		case p, ok := <-c.data:
			if !ok {
				if c.rerr != nil {
					return 0, c.rerr
				}
				return 0, io.EOF
			}
			c.buf, c.frame = p, p
		case <-c.done:
			return 0, net.ErrClosed
		case <-timer:
			return 0, os.ErrDeadlineExceeded
		case <-wake:
		}
	}
	n := copy(b, c.buf)
	c.buf = c.buf[n:]
	if len(c.buf) == 0 {
		if r, ok := c.f.(interface{ release([]byte) }); ok {
			r.release(c.frame) // read: the frame's buffer goes back to its pool
		}
		c.frame = nil
	}
	return n, nil
}

// Write implements net.Conn (write deadlines are not enforced: a stalled
// router stream is ended by Close).
func (c *Conn) Write(b []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	select {
	case <-c.done:
		return 0, net.ErrClosed
	default:
	}
	n := 0
	for n < len(b) {
		end := min(n+c.maxFrame, len(b))
		// Copy: the stream may hold the slice after Send returns.
		p := append([]byte(nil), b[n:end]...)
		if err := c.f.Send(p, pb.FrameType_FRAME_TYPE_DATA); err != nil {
			return n, err
		}
		n = end
	}
	return n, nil
}

// SetMaxFrame bounds the payload of the DATA frames Write sends to n
// bytes instead of MaxFrame (a peer's frame size, as upstream's Python
// client sends a file in 64 KiB frames).
func (c *Conn) SetMaxFrame(n int) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	c.maxFrame = max(n, 1)
}

// CloseWrite sends GOAWAY (end of our bytes) without closing the read side.
func (c *Conn) CloseWrite() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	err := c.f.Send(nil, pb.FrameType_FRAME_TYPE_GOAWAY)
	if cerr := c.f.CloseSend(); err == nil {
		err = cerr
	}
	return err
}

// Close implements net.Conn: GOAWAY and half-close at once, without
// waiting. The stream is canceled only once the peer has ended it (its
// GOAWAY or the end of the stream reached the receive goroutine) or after
// CloseGrace: a cancellation sent right behind the GOAWAY can overtake it
// (a router whose side of the stream is canceled while the GOAWAY waits in
// its receive buffer may never forward it), and the peer, e.g. a client
// idle on a console, would then wait forever. Finished is closed when the
// stream is over.
func (c *Conn) Close() error {
	c.closeOnce.Do(func() {
		close(c.done)
		c.writeMu.Lock()
		_ = c.f.Send(nil, pb.FrameType_FRAME_TYPE_GOAWAY)
		_ = c.f.CloseSend()
		c.writeMu.Unlock()
		go func() {
			defer close(c.finished)
			if c.cancel == nil {
				return // a server stream: it ends when its handler returns
			}
			t := time.NewTimer(CloseGrace)
			defer t.Stop()
			select {
			case <-c.recvDone:
			case <-t.C:
			}
			c.cancel()
		}()
	})
	return nil
}

// Abort ends the Conn without a GOAWAY: the end of the stream is left to
// its owner, which ends it with an error (a server handler returns a
// status, a client cancels), so the peer reads a failure and never the
// clean end of stream a GOAWAY means. Writes fail after it; a Write in
// progress finishes first, so nothing is sent once Abort returns. It does
// nothing after Close (and Close nothing after it).
func (c *Conn) Abort() {
	c.closeOnce.Do(func() {
		c.writeMu.Lock() // a Write in progress finishes first
		close(c.done)
		c.writeMu.Unlock()
		if c.cancel != nil {
			c.cancel()
		}
		close(c.finished)
	})
}

// Done is closed when Close was called.
func (c *Conn) Done() <-chan struct{} { return c.done }

// Finished is closed once Close has ended the stream (canceled it after the
// peer ended it, or after CloseGrace).
func (c *Conn) Finished() <-chan struct{} { return c.finished }

func (c *Conn) LocalAddr() net.Addr  { return c.addr }
func (c *Conn) RemoteAddr() net.Addr { return c.addr }

func (c *Conn) SetDeadline(t time.Time) error {
	_ = c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

func (c *Conn) SetReadDeadline(t time.Time) error {
	c.dlMu.Lock()
	c.readDeadline = t
	close(c.deadlineWake)
	c.deadlineWake = make(chan struct{})
	c.dlMu.Unlock()
	return nil
}

func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.dlMu.Lock()
	c.writeDeadline = t
	c.dlMu.Unlock()
	return nil
}

// Listener hands Conns to a grpc.Server: Accept returns what Put queues.
type Listener struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

// NewListener returns an open Listener.
func NewListener() *Listener {
	return &Listener{ch: make(chan net.Conn), done: make(chan struct{})}
}

// Put hands c to the server; false (and c is closed) once the listener is
// closed or ctx ends first.
func (l *Listener) Put(ctx context.Context, c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
	case <-ctx.Done():
	}
	_ = c.Close()
	return false
}

func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *Listener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *Listener) Addr() net.Addr { return Addr("jumpstarter-router") }
