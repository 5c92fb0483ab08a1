package jumpstarter

import (
	"testing"

	"github.com/stretchr/testify/assert"
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
	a, err := buildTree("ns", "vm", []Port{{Name: "ssh", Port: 22}})
	assert.NoError(t, err)
	b, err := buildTree("ns", "vm", []Port{{Name: "ssh", Port: 22}})
	assert.NoError(t, err)
	c, err := buildTree("ns", "vm-2", nil)
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
