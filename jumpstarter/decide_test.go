package jumpstarter

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestOnStatus(t *testing.T) {
	for _, c := range []struct {
		name              string
		current           string
		leased            bool
		leaseName         string
		reportedAvailable bool
		want              leaseStep
	}{
		{"first message, idle", "", false, "", false, leaseStep{available: "Exporter registered and available"}},
		{"idle again, already reported", "", false, "", true, leaseStep{}},
		{"idle after EndSession-less restart", "", false, "", false, leaseStep{available: "Exporter registered and available"}},
		{"lease assigned", "", true, "l1", true, leaseStep{start: "l1"}},
		{"lease assigned on the first message", "", true, "l1", false, leaseStep{start: "l1"}},
		{"same lease repeated", "l1", true, "l1", false, leaseStep{}},
		{"lease replaced", "l1", true, "l2", false, leaseStep{stop: true, start: "l2"}},
		{"lease ended", "l1", false, "", false, leaseStep{stop: true, available: "Lease ended"}},
		{"leased without a name is not a lease", "", true, "", true, leaseStep{}},
	} {
		assert.Equal(t, c.want, onStatus(c.current, c.leased, c.leaseName, c.reportedAvailable), c.name)
	}
}

func TestTreeAndUUIDs(t *testing.T) {
	a, err := buildTree("ns", "vm", []Port{{Name: "ssh", Port: 22}}, false)
	assert.NoError(t, err)
	b, err := buildTree("ns", "vm", []Port{{Name: "ssh", Port: 22}}, false)
	assert.NoError(t, err)
	c, err := buildTree("ns", "vm-2", nil, false)
	assert.NoError(t, err)
	assert.Equal(t, a[0].uuid, b[0].uuid, "stable across restarts")
	assert.NotEqual(t, a[0].uuid, c[0].uuid, "distinct per exporter")
	seen := map[string]bool{}
	for _, d := range a {
		u, ok := canonicalUUID(d.uuid)
		assert.True(t, ok, d.uuid)
		assert.Equal(t, u, d.uuid, "canonical lowercase")
		assert.Equal(t, byte('5'), d.uuid[14], "version 5")
		assert.False(t, seen[d.uuid])
		seen[d.uuid] = true
	}
	u, ok := canonicalUUID("ABCDEF01-2345-4678-89AB-CDEF01234567")
	assert.True(t, ok)
	assert.Equal(t, "abcdef01-2345-4678-89ab-cdef01234567", u)
	_, ok = canonicalUUID("abcdef0123454678")
	assert.False(t, ok)
}

func TestClassifyAndRetryDelay(t *testing.T) {
	unknown := func(msg string) error { return status.Error(codes.Unknown, msg) }
	for _, c := range []struct {
		name string
		err  error
		want errClass
	}{
		{"transport", errors.New("connection refused"), errTemporary},
		{"unavailable", status.Error(codes.Unavailable, "connection closed"), errTemporary},
		{"authenticator starting", unknown("oidc: authenticator not initialized"), errTemporary},
		{"wrapped, starting", fmt.Errorf("register: %w", unknown("oidc: authenticator not initialized")), errTemporary},
		{"garbage token", unknown("failed to authenticate token"), errTokenRejected},
		{"wrapped garbage token", fmt.Errorf("register: %w", unknown("failed to authenticate token")), errTokenRejected},
		{"unauthenticated", status.Error(codes.Unauthenticated, "missing authorization header"), errTokenRejected},
		{"another's token", status.Error(codes.PermissionDenied, "permission denied for exporter ns/x"), errPermission},
		{"kind mismatch", status.Error(codes.InvalidArgument, "object kind mismatch"), errPermission},
		{"no exporter", unknown(`exporter ns/x: exporters.jumpstarter.dev "x" not found`), errNoExporter},
		{"internal", status.Error(codes.Internal, "unable to update exporter"), errTemporary},
	} {
		assert.Equal(t, c.want, classify(c.err), c.name)
	}

	const s = time.Second
	for _, c := range []struct {
		name       string
		class      errClass
		online     bool
		cur        time.Duration
		wait, next time.Duration
	}{
		{"temporary, first", errTemporary, false, 1 * s, 1 * s, 2 * s},
		{"temporary, capped at 2 s", errTemporary, false, 8 * s, 2 * s, 16 * s},
		{"temporary after online resets", errTemporary, true, 16 * s, 1 * s, 2 * s},
		{"token rejected doubles", errTokenRejected, false, 4 * s, 4 * s, 8 * s},
		{"permission up to max", errPermission, false, 30 * s, 30 * s, 30 * s},
		{"no exporter doubles", errNoExporter, false, 16 * s, 16 * s, 30 * s},
	} {
		wait, next := retryDelay(c.class, c.online, c.cur, 1*s, 30*s)
		assert.Equal(t, c.wait, wait, c.name)
		assert.Equal(t, c.next, next, c.name)
	}
}
