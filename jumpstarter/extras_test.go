package jumpstarter_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// richTarget is a fakeTarget that can also be resized, has a display and
// takes registry credentials in a flash, as the node's VMs do.
type richTarget struct {
	*fakeTarget
	mu       sync.Mutex
	memory   int64
	disk     int64
	maxBytes int64 // sizes over this are refused, as a node over capacity
	creds    []jumpstarter.RegistryCredentials
	parts    []string      // the partition of each FlashOCI
	displays chan net.Conn // the VNC server side of each Display
	books    *jumpstarter.LogBook
}

func (r *richTarget) SetMemorySize(_ context.Context, n int64) error {
	if n > r.maxBytes {
		return fmt.Errorf("%w: memory %d bytes: the node has %d bytes free", jumpstarter.ErrInvalidArgument, n, r.maxBytes)
	}
	r.mu.Lock()
	r.memory = n
	r.mu.Unlock()
	return nil
}

func (r *richTarget) SetDiskSize(_ context.Context, n int64) error {
	if n > r.maxBytes {
		return fmt.Errorf("%w: disk %d bytes: the node has %d bytes free", jumpstarter.ErrInvalidArgument, n, r.maxBytes)
	}
	r.mu.Lock()
	r.disk = n
	r.mu.Unlock()
	return nil
}

func (r *richTarget) Display(context.Context) (io.ReadWriteCloser, error) {
	client, server := net.Pipe()
	r.displays <- server
	return client, nil
}

func (r *richTarget) FlashOCI(ctx context.Context, f jumpstarter.OCIFlash, progress func(string)) error {
	r.mu.Lock()
	if f.Credentials != nil {
		r.creds = append(r.creds, *f.Credentials)
	}
	r.parts = append(r.parts, f.Partition)
	r.mu.Unlock()
	if f.Credentials != nil {
		r.books.Printf(jumpstarter.DriverFlasher, jumpstarter.SeverityInfo, "pulling %s as %s", f.Ref, f.Credentials.Username)
	}
	return r.fakeTarget.Flash(ctx, f.Ref, progress)
}

// leasedSession starts an exporter over target (mutate adjusts its
// config), leases it and returns a client session and the driver UUIDs.
func leasedSession(t *testing.T, mutate func(*jumpstarter.Config)) (*env, *jstest.Session, func(string) string) {
	t.Helper()
	e := startEnv(t, true, mutate)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-x", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	s, err := e.ctrl.NewClient(ns, "alice").Dial(ctx, "lease-x")
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	return e, s, func(n string) string {
		d, ok := jstest.FindDriver(rep, n)
		require.True(t, ok, "driver %q in the report", n)
		return d.GetUuid()
	}
}

// newRich extends the env's fake target c.Target.
func newRich(c *jumpstarter.Config, book *jumpstarter.LogBook) *richTarget {
	return &richTarget{fakeTarget: c.Target.(*fakeTarget), maxBytes: 8 << 30, displays: make(chan net.Conn, 4), books: book}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{
		"20G": 20 << 30, "2G": 2 << 30, "512M": 512 << 20, "2T": 2 << 40, "64k": 64 << 10, "1.5G": 3 << 29,
		"1GB": 1e9, "1gb": 1e9, "2GiB": 2 << 30, "300MiB": 300 << 20, "1024": 1024, " 1_024 ": 1024, "100b": 100, "3kB": 3000, "1 MiB": 1 << 20,
	} {
		got, err := jumpstarter.ParseSize(in)
		if assert.NoError(t, err, in) {
			assert.Equal(t, want, got, in)
		}
	}
	for _, in := range []string{"", "G", "-1G", "0", "0G", "abc", "20X", "1e3", "20 GX", "99999999999T", "2__0", "8bit"} {
		_, err := jumpstarter.ParseSize(in)
		assert.ErrorIs(t, err, jumpstarter.ErrInvalidArgument, "%q", in)
	}
	_, err := jumpstarter.ParseSize("abc")
	assert.EqualError(t, err, "invalid argument: Invalid size: 'abc'. Use e.g. '20G', '512M', '2T'")
}

// TestResizeCalls: set_memory_size and set_disk_size reach the target with
// upstream's sizes; bad sizes and sizes the target refuses fail the call
// with InvalidArgument and leave the target's sizes as they were.
func TestResizeCalls(t *testing.T) {
	var rt *richTarget
	_, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		c.Logs = jumpstarter.NewLogBook()
		rt = newRich(c, c.Logs)
		c.Target = rt
	})
	ctx := ctxT(t, 30*time.Second)
	root := uuidOf("")
	_, err := s.Call(ctx, root, "set_memory_size", "2G")
	require.NoError(t, err)
	_, err = s.Call(ctx, root, "set_disk_size", "20GB")
	require.Error(t, err, "over the target's capacity")
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Contains(t, err.Error(), "the node has 8589934592 bytes free")
	_, err = s.Call(ctx, root, "set_disk_size", "4G")
	require.NoError(t, err)
	for _, bad := range []any{"", "lots", "-2G", "0", float64(2048), nil} {
		_, err = s.Call(ctx, root, "set_memory_size", bad)
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "set_memory_size(%#v): %v", bad, err)
	}
	_, err = s.Call(ctx, root, "set_memory_size")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "no argument: %v", err)
	_, err = s.Call(ctx, root, "set_memory_size", "1G", "2G")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "two arguments: %v", err)
	rt.mu.Lock()
	assert.Equal(t, int64(2<<30), rt.memory, "refused calls left the memory size")
	assert.Equal(t, int64(4<<30), rt.disk, "refused calls left the disk size")
	rt.mu.Unlock()
}

// TestResizeUnsupported: a target that cannot be resized answers
// Unimplemented, as upstream does for a method a driver lacks behaviour for.
func TestResizeUnsupported(t *testing.T) {
	_, s, uuidOf := leasedSession(t, nil) // plain fakeTarget: no Resizer
	_, err := s.Call(ctxT(t, 10*time.Second), uuidOf(""), "set_memory_size", "1G")
	assert.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
}

// TestDisplayChild: with Config.Display the report has a vnc NetworkClient
// child whose connect stream is the target's display, bytes both ways.
func TestDisplayChild(t *testing.T) {
	var rt *richTarget
	e, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		rt = newRich(c, nil)
		c.Target = rt
		c.Display = true
	})
	ctx := ctxT(t, 30*time.Second)
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	require.Len(t, rep.GetReports(), 7, "root, power, flasher, console, vnc, http, ssh")
	vnc, ok := jstest.FindDriver(rep, "vnc")
	require.True(t, ok)
	assert.Equal(t, jumpstarter.ClassNetwork, vnc.GetLabels()[jumpstarter.LabelClient])
	conn, err := s.Stream(ctx, uuidOf("vnc"), "connect")
	require.NoError(t, err)
	var srv net.Conn
	select {
	case srv = <-rt.displays:
	case <-ctx.Done():
		t.Fatal("the display was not opened on the target")
	}
	go func() { _, _ = srv.Write([]byte("RFB 003.008\n")) }()
	buf := make([]byte, 12)
	_, err = io.ReadFull(conn, buf)
	require.NoError(t, err)
	assert.Equal(t, "RFB 003.008\n", string(buf))
	_, err = conn.Write([]byte("RFB 003.008\n"))
	require.NoError(t, err)
	got := make([]byte, 12)
	_, err = io.ReadFull(srv, got)
	require.NoError(t, err)
	assert.Equal(t, "RFB 003.008\n", string(got))
	conn.Close()
	srv.Close()
	require.Eventually(t, func() bool {
		e.rec.mu.Lock()
		defer e.rec.mu.Unlock()
		return e.rec.opened["vnc"] == 1 && e.rec.closed["vnc"] == 1
	}, 10*time.Second, 10*time.Millisecond, "the vnc stream is counted as kind vnc")

	// Without Display there is no vnc child; Display on a target without
	// one is a config error.
	_, err = jumpstarter.New(jumpstarter.Config{Endpoint: "x:1", Token: "t", Namespace: "n", Name: "v", Target: newFakeTarget(), Display: true})
	assert.ErrorContains(t, err, "not a Displayer")
	_, err = jumpstarter.New(jumpstarter.Config{Endpoint: "x:1", Token: "t", Namespace: "n", Name: "v", Target: rt,
		Display: true, Ports: []jumpstarter.Port{{Name: "vnc", Port: 5900}}})
	assert.ErrorContains(t, err, "the name is taken")
}

// TestFlashOCICredentials: flash_oci's oci_username/oci_password reach the
// target for that call, onto root and onto a firmware partition (as
// upstream's QEMU driver takes them for every partition); half a pair,
// non-strings or a target that takes no credentials are refused; the
// password appears in no log, no LogStream line and no error.
func TestFlashOCICredentials(t *testing.T) {
	const password = "s3cret-Registry-Passw0rd"
	var rt *richTarget
	e, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		c.Logs = jumpstarter.NewLogBook()
		rt = newRich(c, c.Logs)
		c.Target = rt
	})
	ctx := ctxT(t, 30*time.Second)
	logs, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
	require.NoError(t, err)
	flasher := uuidOf("flasher")
	var last []any
	err = s.StreamingCall(ctx, flasher, "flash_oci", []any{"oci://registry.local/private/os:1", "root", "robot", password}, func(v any) error {
		last, _ = v.([]any)
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []any{"", "", float64(0)}, last)
	rt.mu.Lock()
	assert.Equal(t, []jumpstarter.RegistryCredentials{{Username: "robot", Password: password}}, rt.creds)
	rt.mu.Unlock()
	assert.NotContains(t, fmt.Sprintf("%v %+v %#v", rt.creds[0], rt.creds[0], rt.creds[0]), password, "formatting hides the password")

	var errs []string
	for _, a := range [][]any{
		{"oci://r/x:1", nil, "robot", nil},
		{"oci://r/x:1", nil, nil, password},
		{"oci://r/x:1", nil, "robot", float64(1)},
	} {
		err := s.StreamingCall(ctx, flasher, "flash_oci", a, func(any) error { return nil })
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		errs = append(errs, fmt.Sprint(err))
	}
	assert.NotContains(t, strings.Join(errs, "\n"), password)
	require.NoError(t, s.StreamingCall(ctx, flasher, "flash_oci", []any{"oci://registry.local/private/fw:1", "OVMF_CODE.fd", "robot2", password}, func(any) error { return nil }))
	rt.mu.Lock()
	assert.Equal(t, []jumpstarter.RegistryCredentials{{Username: "robot", Password: password}, {Username: "robot2", Password: password}}, rt.creds)
	assert.Equal(t, []string{"root", "OVMF_CODE.fd"}, rt.parts, "credentials for every partition")
	rt.mu.Unlock()

	// The flash's lines reached LogStream; none holds the password.
	var msgs []string
	for len(msgs) == 0 || !strings.HasPrefix(msgs[len(msgs)-1], "flashed ") {
		r, err := logs.Recv()
		require.NoError(t, err)
		msgs = append(msgs, r.GetMessage())
		assert.NotContains(t, r.String(), password)
	}
	assert.Equal(t, []string{"lease lease-x assigned to client alice", "flashing registry.local/private/os:1",
		"pulling registry.local/private/os:1 as robot", "pulling registry.local/private/os:1", "verifying registry.local/private/os:1",
		"powering off, replacing the disk, powering on", "flashed registry.local/private/os:1"}, msgs)
	assert.NotContains(t, e.logs.String(), password, "never logged")

	// A target that takes no credentials refuses them, clearly.
	_, s2, uuid2 := leasedSession(t, nil)
	err = s2.StreamingCall(ctx, uuid2("flasher"), "flash_oci", []any{"oci://r/x:1", nil, "robot", password}, func(any) error { return nil })
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.ErrorContains(t, err, "registry credentials in the call are not supported by this target")
	assert.NotContains(t, err.Error(), password)
}

// TestLogStream: the exporter's lines for the target come out in
// upstream's LogStreamResponse shape, from the lease's start on; a stream
// opened later gets the lines no stream took yet, and no line twice.
func TestLogStream(t *testing.T) {
	book := jumpstarter.NewLogBook()
	book.Printf("", jumpstarter.SeverityInfo, "before the lease: not shown")
	e, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		c.Logs = book
		c.Target = newRich(c, book)
	})
	ctx := ctxT(t, 30*time.Second)
	_, err := s.Call(ctx, uuidOf("power"), "on")
	require.NoError(t, err)
	e.target.mu.Lock()
	e.target.flashErr["r/bad:1"] = errors.New("manifest unknown")
	e.target.mu.Unlock()
	err = s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://r/bad:1"}, func(any) error { return nil })
	require.Error(t, err)

	st, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
	require.NoError(t, err)
	var got []*pb.LogStreamResponse
	for len(got) < 6 {
		r, err := st.Recv()
		require.NoError(t, err)
		got = append(got, r)
	}
	assert.Equal(t, "lease lease-x assigned to client alice", got[0].GetMessage())
	assert.Equal(t, pb.LogSource_LOG_SOURCE_SYSTEM, got[0].GetSource())
	assert.Equal(t, "powering on", got[1].GetMessage())
	assert.Equal(t, pb.LogSource_LOG_SOURCE_DRIVER, got[1].GetSource())
	assert.Equal(t, "power", got[1].GetDriverType())
	assert.Equal(t, "power on", got[1].GetOperation())
	assert.Equal(t, "INFO", got[1].GetSeverity())
	assert.Equal(t, "", got[1].GetUuid(), "upstream's handler sends no uuid")
	assert.WithinDuration(t, time.Now(), got[1].GetTimestamp().AsTime(), time.Minute)
	assert.Equal(t, "powered on", got[2].GetMessage())
	assert.Equal(t, "flashing r/bad:1", got[3].GetMessage())
	assert.Equal(t, "pulling r/bad:1", got[4].GetMessage())
	assert.Equal(t, "ERROR", got[5].GetSeverity())
	assert.Contains(t, got[5].GetMessage(), "manifest unknown")

	// A line added now goes to every open stream; a stream opened later
	// does not get the lines an earlier one took.
	book.Printf("power", jumpstarter.SeverityWarning, "guest powered itself off")
	r, err := st.Recv()
	require.NoError(t, err)
	assert.Equal(t, "guest powered itself off", r.GetMessage())
	assert.Equal(t, "WARNING", r.GetSeverity())
	sctx, cancel := context.WithCancel(ctx)
	st2, err := s.Exporter.LogStream(sctx, &emptypb.Empty{})
	require.NoError(t, err)
	_, err = st2.Header() // the stream is in place
	require.NoError(t, err)
	book.Printf("power", jumpstarter.SeverityInfo, "next")
	r2, err := st2.Recv()
	require.NoError(t, err)
	assert.Equal(t, "next", r2.GetMessage(), "the second stream starts after what the first took")
	r, err = st.Recv()
	require.NoError(t, err)
	assert.Equal(t, "next", r.GetMessage(), "and the first stream gets the new line too")
	cancel()
}

// TestLogBookBounded: the book keeps the last LogBookSize lines.
func TestLogBookBounded(t *testing.T) {
	book := jumpstarter.NewLogBook()
	e, s, _ := leasedSession(t, func(c *jumpstarter.Config) { c.Logs = book })
	_ = e
	for i := 0; i < jumpstarter.LogBookSize+50; i++ {
		book.Printf("", jumpstarter.SeverityInfo, "line %d", i)
	}
	ctx := ctxT(t, 10*time.Second)
	st, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
	require.NoError(t, err)
	r, err := st.Recv()
	require.NoError(t, err)
	assert.Equal(t, "line 50", r.GetMessage(), "the oldest kept line (the lease's own first line was dropped too)")
}
