package streamconn

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

type frame struct {
	p  []byte
	ft pb.FrameType
}

// chanFrames is an in-memory Frames: in feeds Recv, Send appends to sent.
type chanFrames struct {
	in   chan frame
	mu   sync.Mutex
	sent []frame
	half bool
}

func (c *chanFrames) Send(p []byte, ft pb.FrameType) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sent = append(c.sent, frame{p, ft})
	return nil
}

func (c *chanFrames) Recv() ([]byte, pb.FrameType, error) {
	f, ok := <-c.in
	if !ok {
		return nil, 0, io.EOF
	}
	return f.p, f.ft, nil
}

func (c *chanFrames) CloseSend() error {
	c.mu.Lock()
	c.half = true
	c.mu.Unlock()
	return nil
}

func TestConnFrames(t *testing.T) {
	f := &chanFrames{in: make(chan frame, 8)}
	cancelled := make(chan struct{})
	c := New(f, func() { close(cancelled) }, "test")

	// PING and empty DATA are skipped; DATA is read across Read calls.
	f.in <- frame{nil, pb.FrameType_FRAME_TYPE_PING}
	f.in <- frame{[]byte{}, pb.FrameType_FRAME_TYPE_DATA}
	f.in <- frame{[]byte("hello"), pb.FrameType_FRAME_TYPE_DATA}
	buf := make([]byte, 3)
	n, err := c.Read(buf)
	require.NoError(t, err)
	assert.Equal(t, "hel", string(buf[:n]))
	n, err = c.Read(buf)
	require.NoError(t, err)
	assert.Equal(t, "lo", string(buf[:n]))

	// A read deadline expires; clearing it lets the next frame through.
	require.NoError(t, c.SetReadDeadline(time.Now().Add(30*time.Millisecond)))
	_, err = c.Read(buf)
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, c.SetReadDeadline(time.Time{}))

	// Writes are split into MaxFrame DATA frames.
	big := bytes.Repeat([]byte("x"), MaxFrame*2+10)
	n, err = c.Write(big)
	require.NoError(t, err)
	assert.Equal(t, len(big), n)
	f.mu.Lock()
	require.Len(t, f.sent, 3)
	assert.Len(t, f.sent[0].p, MaxFrame)
	assert.Len(t, f.sent[2].p, 10)
	f.mu.Unlock()

	// GOAWAY ends the read side.
	f.in <- frame{nil, pb.FrameType_FRAME_TYPE_GOAWAY}
	_, err = c.Read(buf)
	assert.ErrorIs(t, err, io.EOF)

	// Close: GOAWAY sent, half-closed; the peer already ended the stream
	// (its GOAWAY), so it is cancelled at once; writes fail after.
	require.NoError(t, c.Close())
	require.NoError(t, c.Close())
	f.mu.Lock()
	assert.Equal(t, pb.FrameType_FRAME_TYPE_GOAWAY, f.sent[len(f.sent)-1].ft)
	assert.True(t, f.half)
	f.mu.Unlock()
	select {
	case <-c.Finished():
	case <-time.After(CloseGrace / 2):
		t.Fatal("a stream the peer had ended was not finished at once")
	}
	select {
	case <-cancelled:
	default:
		t.Fatal("Finished before the stream was cancelled")
	}
	_, err = c.Write([]byte("late"))
	assert.ErrorIs(t, err, net.ErrClosed)
}

// TestCloseCancelsAfterThePeerEnds: Close sends GOAWAY and half-closes at
// once but cancels the stream only when the peer has ended it, so that the
// GOAWAY is not overtaken by the cancellation (a router may drop frames of a
// stream it sees cancelled); a peer that never answers is cancelled after
// CloseGrace.
func TestCloseCancelsAfterThePeerEnds(t *testing.T) {
	for _, peerEnds := range []bool{true, false} {
		f := &chanFrames{in: make(chan frame, 1)}
		cancelled := make(chan struct{})
		c := New(f, func() { close(cancelled) }, "test")
		start := time.Now()
		require.NoError(t, c.Close())
		f.mu.Lock()
		require.NotEmpty(t, f.sent)
		assert.Equal(t, pb.FrameType_FRAME_TYPE_GOAWAY, f.sent[len(f.sent)-1].ft, "GOAWAY sent at once")
		assert.True(t, f.half, "half-closed at once")
		f.mu.Unlock()
		select {
		case <-cancelled:
			t.Fatal("cancelled before the peer ended the stream")
		case <-time.After(100 * time.Millisecond):
		}
		if peerEnds {
			close(f.in) // the router ends the stream: Recv returns io.EOF
			select {
			case <-c.Finished():
			case <-time.After(CloseGrace / 2):
				t.Fatal("not finished once the peer ended the stream")
			}
		} else {
			<-c.Finished()
			assert.GreaterOrEqual(t, time.Since(start), CloseGrace, "a silent peer gets CloseGrace")
		}
		select {
		case <-cancelled:
		default:
			t.Fatal("finished without cancelling the stream")
		}
	}
}

func TestConnRST(t *testing.T) {
	f := &chanFrames{in: make(chan frame, 1)}
	c := New(f, nil, "test")
	f.in <- frame{nil, pb.FrameType_FRAME_TYPE_RST_STREAM}
	_, err := c.Read(make([]byte, 1))
	assert.ErrorIs(t, err, io.EOF)
}

func TestListener(t *testing.T) {
	l := NewListener()
	a, b := net.Pipe()
	defer b.Close()
	go func() { assert.True(t, l.Put(context.Background(), a)) }()
	got, err := l.Accept()
	require.NoError(t, err)
	assert.Equal(t, a, got)
	require.NoError(t, l.Close())
	_, err = l.Accept()
	assert.True(t, errors.Is(err, net.ErrClosed))
	c, d := net.Pipe()
	defer d.Close()
	assert.False(t, l.Put(context.Background(), c), "Put after Close refuses and closes")
	_, err = c.Write([]byte("x"))
	assert.Error(t, err)
}

// TestAbortSendsNoGoaway: Abort ends the Conn without the GOAWAY that
// would read as a clean end of stream on the peer; a client's stream is
// cancelled at once, writes fail after, and a later Close sends nothing.
func TestAbortSendsNoGoaway(t *testing.T) {
	f := &chanFrames{in: make(chan frame, 1)}
	cancelled := make(chan struct{})
	c := New(f, func() { close(cancelled) }, "test")
	_, err := c.Write([]byte("sent"))
	require.NoError(t, err)
	c.Abort()
	select {
	case <-cancelled:
	default:
		t.Fatal("Abort did not cancel the stream")
	}
	select {
	case <-c.Finished():
	default:
		t.Fatal("not finished after Abort")
	}
	_, err = c.Write([]byte("late"))
	assert.ErrorIs(t, err, net.ErrClosed)
	require.NoError(t, c.Close())
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.sent, 1, "only the DATA frame written before Abort")
	assert.Equal(t, pb.FrameType_FRAME_TYPE_DATA, f.sent[0].ft)
	assert.False(t, f.half, "no half-close")
}
