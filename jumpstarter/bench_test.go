package jumpstarter_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

func medianDur(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// baselineServer is a plain ExporterService on loopback, no router, no
// lease: what the same calls cost without Jumpstarter's plumbing.
type baselineServer struct {
	pb.UnimplementedExporterServiceServer
}

func (baselineServer) GetReport(context.Context, *emptypb.Empty) (*pb.GetReportResponse, error) {
	return &pb.GetReportResponse{Uuid: "00000000-0000-4000-8000-000000000000"}, nil
}

func (baselineServer) DriverCall(context.Context, *pb.DriverCallRequest) (*pb.DriverCallResponse, error) {
	return &pb.DriverCallResponse{Result: structpb.NewStringValue("vm-0.lab")}, nil
}

func startBaseline(b *testing.B) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	s := grpc.NewServer()
	pb.RegisterExporterServiceServer(s, baselineServer{})
	go func() { _ = s.Serve(l) }()
	b.Cleanup(s.Stop)
	return l.Addr().String()
}

// baselineFirstCall: new connection, GetReport, DriverCall.
func baselineFirstCall(b *testing.B, addr string) time.Duration {
	ctx := context.Background()
	t0 := time.Now()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	defer cc.Close()
	c := pb.NewExporterServiceClient(cc)
	_, err = c.GetReport(ctx, &emptypb.Empty{})
	require.NoError(b, err)
	_, err = c.DriverCall(ctx, &pb.DriverCallRequest{Method: "get_hostname"})
	require.NoError(b, err)
	return time.Since(t0)
}

// BenchmarkLeaseToFirstCall: a lease assigned to a warm (Online) exporter
// -> the client's first answered DriverCall, through the controller's Dial
// and the router like jmp (Dial waits for LEASE_READY, then GetReport and
// get_hostname over the router stream); baseline: a new plain gRPC
// connection on loopback with the same two calls. 7 of each per iteration,
// alternating; x-of-baseline = median / median. Plaintext on both sides.
func BenchmarkLeaseToFirstCall(b *testing.B) {
	e := startEnv(b, true, nil)
	ctx := context.Background()
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(b, err)
	cl := e.ctrl.NewClient(ns, "alice")
	base := startBaseline(b)
	var ours, bases []time.Duration
	n := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 7; j++ {
			n++
			bases = append(bases, baselineFirstCall(b, base))
			lease := fmt.Sprintf("bench-%d", n)
			t0 := time.Now()
			require.NoError(b, e.ctrl.AssignLease(ns, lease, name, "alice"))
			s, err := cl.Dial(ctx, lease)
			require.NoError(b, err)
			rep, err := s.GetReport(ctx)
			require.NoError(b, err)
			root, _ := jstest.FindDriver(rep, "")
			_, err = s.Call(ctx, root.GetUuid(), "get_hostname")
			require.NoError(b, err)
			ours = append(ours, time.Since(t0))
			s.Close()
			require.NoError(b, e.ctrl.EndLease(ns, lease))
			_, err = e.ctrl.WaitExporter(ctx, ns, name, online)
			require.NoError(b, err)
		}
	}
	b.StopTimer()
	mo, mb := medianDur(ours), medianDur(bases)
	b.ReportMetric(float64(mo.Microseconds())/1000, "ms/first-call")
	b.ReportMetric(float64(mb.Microseconds())/1000, "ms/baseline")
	b.ReportMetric(float64(mo)/float64(mb), "x-of-baseline")
}

// BenchmarkConsoleRoundTrip: one line written to the console stream and
// echoed by the guest, through the router (client -> router -> exporter's
// gRPC server -> Target.Console and back); baseline: a unary gRPC call on
// an established loopback connection. 21 of each per iteration.
func BenchmarkConsoleRoundTrip(b *testing.B) {
	e := startEnv(b, true, nil)
	ctx := context.Background()
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(b, err)
	require.NoError(b, e.ctrl.AssignLease(ns, "bench", name, "alice"))
	s, err := e.ctrl.NewClient(ns, "alice").Dial(ctx, "bench")
	require.NoError(b, err)
	defer s.Close()
	rep, err := s.GetReport(ctx)
	require.NoError(b, err)
	con, _ := jstest.FindDriver(rep, "console")
	c, err := s.Stream(ctx, con.GetUuid(), "connect")
	require.NoError(b, err)
	defer c.Close()
	guest := <-e.target.consoles
	go func() { _, _ = io.Copy(guest, guest) }() // the guest echoes

	cc, err := grpc.NewClient(startBaseline(b), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	defer cc.Close()
	bc := pb.NewExporterServiceClient(cc)
	_, err = bc.GetReport(ctx, &emptypb.Empty{}) // connect
	require.NoError(b, err)

	buf := make([]byte, 6)
	var ours, bases []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 21; j++ {
			t0 := time.Now()
			_, err = bc.DriverCall(ctx, &pb.DriverCallRequest{Method: "get_hostname"})
			require.NoError(b, err)
			bases = append(bases, time.Since(t0))
			t0 = time.Now()
			_, err = c.Write([]byte("ping\r\n"))
			require.NoError(b, err)
			_, err = io.ReadFull(c, buf)
			require.NoError(b, err)
			ours = append(ours, time.Since(t0))
			require.Equal(b, "ping\r\n", string(buf))
		}
	}
	b.StopTimer()
	mo, mb := medianDur(ours), medianDur(bases)
	b.ReportMetric(float64(mo.Microseconds()), "us/console-rtt")
	b.ReportMetric(float64(mb.Microseconds()), "us/baseline")
	b.ReportMetric(float64(mo)/float64(mb), "x-of-baseline")
}
