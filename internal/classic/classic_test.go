package classic

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
)

func TestClassicIsExactAndIdempotent(t *testing.T) {
	for _, path := range []string{":memory:", filepath.Join(t.TempDir(), "c.db")} {
		s, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		s.SetQuota(ctx, "a", 3)
		for i, c := range []struct {
			id      string
			units   int64
			new     bool
			wantErr error
		}{{"e1", 2, true, nil}, {"e1", 2, false, nil}, {"e2", 2, false, ErrQuotaExceeded}, {"e2", 1, true, nil}} {
			n, err := s.Charge(ctx, "a", c.id, c.units)
			if n != c.new || !errors.Is(err, c.wantErr) {
				t.Fatalf("%s step %d: %v %v", path, i, n, err)
			}
		}
		if used, _ := s.Used(ctx, "a"); used != 3 {
			t.Fatalf("used %d", used)
		}
		s.Close()
	}
}
