package jstest

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// These tests pin the double's upstream semantics with raw protocol calls
// (the exporter's own tests exercise it end to end).

func rawConn(t *testing.T, addr string) *grpc.ClientConn {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return cc
}

func exporterCtx(ctx context.Context, token, ns, name string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token,
		"jumpstarter-kind", "Exporter", "jumpstarter-namespace", ns, "jumpstarter-name", name)
}

func TestControllerSemantics(t *testing.T) {
	c, err := Start(Options{Insecure: true, DialWait: 300 * time.Millisecond})
	require.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tok := c.AddExporter("ns", "e1", "")
	ctl := pb.NewControllerServiceClient(rawConn(t, c.Endpoint()))
	ectx := exporterCtx(ctx, tok, "ns", "e1")

	// Authentication, with the codes and messages of the real controller
	// (b1f2bb41, seen live).
	c.AddExporter("ns", "e2", "")
	clTok := c.AddClient("ns", "cl", "")
	for _, a := range []struct {
		name string
		ctx  context.Context
		code codes.Code
		msg  string
	}{
		{"no token", ctx, codes.Unauthenticated, "missing authorization header"},
		{"garbage token", exporterCtx(ctx, "wrong", "ns", "e1"), codes.Unknown, "failed to authenticate token"},
		{"no such exporter", exporterCtx(ctx, tok, "other", "e1"), codes.Unknown, `exporter other/e1: exporters.jumpstarter.dev "e1" not found`},
		{"another exporter's token", exporterCtx(ctx, tok, "ns", "e2"), codes.PermissionDenied, "permission denied for exporter ns/e2"},
		{"a client's token", exporterCtx(ctx, clTok, "ns", "e1"), codes.PermissionDenied, "permission denied for exporter ns/e1"},
		{"kind mismatch", metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok, "jumpstarter-kind", "Client",
			"jumpstarter-namespace", "ns", "jumpstarter-name", "e1"), codes.InvalidArgument, "object kind mismatch"},
	} {
		_, err = ctl.Register(a.ctx, &pb.RegisterRequest{})
		assert.Equal(t, a.code, status.Code(err), "%s: %v", a.name, err)
		assert.Equal(t, a.msg, status.Convert(err).Message(), a.name)
	}

	// Register keeps only jumpstarter.dev/ labels; not Online until Status.
	_, err = ctl.Register(ectx, &pb.RegisterRequest{Labels: map[string]string{"jumpstarter.dev/a": "1", "b": "2"}})
	require.NoError(t, err)
	st, _ := c.ExporterState("ns", "e1")
	assert.True(t, st.Registered)
	assert.False(t, st.Online)
	assert.Equal(t, map[string]string{"jumpstarter.dev/a": "1"}, st.Labels)

	sctx, scancel := context.WithCancel(ectx)
	stream, err := ctl.Status(sctx, &pb.StatusRequest{})
	require.NoError(t, err)
	m, err := stream.Recv()
	require.NoError(t, err)
	assert.False(t, m.GetLeased(), "first Status message: not leased")
	_, err = c.WaitExporter(ctx, "ns", "e1", func(s ExporterState) bool { return s.Online })
	require.NoError(t, err)

	// A lease: Status says so; Dial needs LEASE_READY (Available is waited
	// for, then FailedPrecondition) and a listener (else Unavailable).
	require.NoError(t, c.AssignLease("ns", "l1", "e1", "cl"))
	m, err = stream.Recv()
	require.NoError(t, err)
	assert.True(t, m.GetLeased())
	assert.Equal(t, "l1", m.GetLeaseName())
	assert.Equal(t, "cl", m.GetClientName())

	_, err = ctl.ReportStatus(ectx, &pb.ReportStatusRequest{Status: pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE})
	require.NoError(t, err)
	cl := c.NewClient("ns", "cl")
	cl.DialTimeout = time.Second
	t0 := time.Now()
	_, err = ctl.Dial(cl.withAuth(ctx, cl.token), &pb.DialRequest{LeaseName: "l1"})
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "Dial while Available: %v", err)
	assert.GreaterOrEqual(t, time.Since(t0), 250*time.Millisecond, "Available is waited for (DialWait)")
	other := c.NewClient("ns", "mallory")
	_, err = other.DialToken(ctx, "l1")
	assert.Equal(t, codes.Unknown, status.Code(err), "a client that does not hold the lease: %v", err)
	assert.Contains(t, err.Error(), "desc = permission denied")

	_, err = ctl.ReportStatus(ectx, &pb.ReportStatusRequest{Status: pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY})
	require.NoError(t, err)
	_, err = ctl.Dial(cl.withAuth(ctx, cl.token), &pb.DialRequest{LeaseName: "l1"})
	assert.Equal(t, codes.Unavailable, status.Code(err), "Dial with no listener: %v", err)
	_, err = ctl.Dial(cl.withAuth(ctx, cl.token), &pb.DialRequest{LeaseName: "nope"})
	assert.Equal(t, codes.Unknown, status.Code(err), "Dial on an unknown lease: %v", err)
	assert.Equal(t, `leases.jumpstarter.dev "nope" not found`, status.Convert(err).Message())

	// Listen: only for a lease the exporter holds.
	bad, err := ctl.Listen(ectx, &pb.ListenRequest{LeaseName: "nope"})
	require.NoError(t, err)
	_, err = bad.Recv()
	assert.Error(t, err, "Listen on a lease not held")
	lctx, lcancel := context.WithCancel(ectx)
	defer lcancel()
	ls, err := ctl.Listen(lctx, &pb.ListenRequest{LeaseName: "l1"})
	require.NoError(t, err)
	require.NoError(t, c.WaitFor(ctx, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		_, ok := c.listeners[key{"ns", "l1"}]
		return ok
	}))
	dr, err := cl.DialToken(ctx, "l1")
	require.NoError(t, err)
	lr, err := ls.Recv()
	require.NoError(t, err)
	assert.Equal(t, dr.GetRouterToken(), lr.GetRouterToken(), "the exporter gets the client's token")
	assert.Equal(t, c.RouterEndpoint(), lr.GetRouterEndpoint())

	// The router pairs the two streams with that token and forwards frames.
	router := pb.NewRouterServiceClient(rawConn(t, c.RouterEndpoint()))
	bearer := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	_, err = func() (*pb.StreamResponse, error) {
		s, err := router.Stream(bearer("bogus"))
		if err != nil {
			return nil, err
		}
		return s.Recv()
	}()
	assert.Equal(t, codes.Unauthenticated, status.Code(err), "router with a bogus token: %v", err)
	a, err := router.Stream(bearer(dr.GetRouterToken()))
	require.NoError(t, err)
	require.NoError(t, c.WaitFor(ctx, func() bool { return c.PendingStreams() == 1 }))
	bs, err := router.Stream(bearer(lr.GetRouterToken()))
	require.NoError(t, err)
	require.NoError(t, a.Send(&pb.StreamRequest{Payload: []byte("hello")}))
	got, err := bs.Recv()
	require.NoError(t, err)
	assert.Equal(t, "hello", string(got.GetPayload()))
	require.NoError(t, bs.Send(&pb.StreamRequest{FrameType: pb.FrameType_FRAME_TYPE_GOAWAY}))
	got, err = a.Recv()
	require.NoError(t, err)
	assert.Equal(t, pb.FrameType_FRAME_TYPE_GOAWAY, got.GetFrameType())
	require.NoError(t, bs.CloseSend())
	require.NoError(t, a.CloseSend())
	for _, s := range []pb.RouterService_StreamClient{a, bs} {
		_, err = s.Recv()
		assert.ErrorIs(t, err, io.EOF)
	}

	// Lease end: Status says not leased; Status closed: Offline-ish (not Online).
	require.NoError(t, c.EndLease("ns", "l1"))
	m, err = stream.Recv()
	require.NoError(t, err)
	assert.False(t, m.GetLeased())
	_, err = ctl.Dial(cl.withAuth(ctx, cl.token), &pb.DialRequest{LeaseName: "l1"})
	assert.Equal(t, codes.Unknown, status.Code(err), "Dial on an ended lease: %v", err)
	assert.Equal(t, "lease not active", status.Convert(err).Message())
	scancel()
	_, err = c.WaitExporter(ctx, "ns", "e1", func(s ExporterState) bool { return !s.Online })
	require.NoError(t, err)

	// Unregister: not registered, status OFFLINE.
	_, err = ctl.Unregister(ectx, &pb.UnregisterRequest{Reason: "bye"})
	require.NoError(t, err)
	st, _ = c.ExporterState("ns", "e1")
	assert.False(t, st.Registered)
	assert.True(t, st.Unregistered)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE, st.Status)
	assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE}, st.StatusHistory)
}

// TestControllerRestartKeepsState: Stop fails every stream, Start serves
// the same state on the same addresses.
func TestControllerRestartKeepsState(t *testing.T) {
	c, err := Start(Options{})
	require.NoError(t, err)
	defer c.Close()
	require.NotEmpty(t, c.CABundle(), "TLS by default")
	addr, raddr := c.Endpoint(), c.RouterEndpoint()
	c.AddExporter("ns", "e1", "tok")
	c.Stop()
	require.NoError(t, c.Start())
	assert.Equal(t, addr, c.Endpoint())
	assert.Equal(t, raddr, c.RouterEndpoint())
	_, ok := c.ExporterState("ns", "e1")
	assert.True(t, ok)
}
